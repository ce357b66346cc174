"""Which path eager calls take (twell.routing): short calls dense, long ones on the kernels unless their measured
activity predicts a loss."""
import pytest
import torch

from twell.cost_model import dense_time
from twell.routing import EAGER_MIN_DENSE_S, ActivityRouter, eager_dense


def test_eager_dense_where_the_dense_block_is_short():
    """Eager calls run dense up to where the dense block's predicted time reaches EAGER_MIN_DENSE_S: between
    4096 and 16384 tokens at D 2048 / I 5632, from fewer tokens on a wider layer."""
    assert eager_dense(1, 2048, 5632) and eager_dense(4096, 2048, 5632) and not eager_dense(16384, 2048, 5632)
    first = next(n for n in range(1, 1 << 17) if not eager_dense(n, 2048, 5632))
    assert dense_time(2048, 5632, first) >= EAGER_MIN_DENSE_S > dense_time(2048, 5632, first - 1)
    assert next(n for n in range(1, 1 << 17) if not eager_dense(n, 4096, 14336)) < first


def test_loses_where_heavy_rows_outweigh_the_saving():
    """The cost model's verdict at D 2048 / I 5632, 29 active units: no heavy rows win at 4096 tokens, every
    row heavy loses, and the verdict flips once between."""
    router = ActivityRouter(2048, 5632, 128, 29.0)
    shares = [n / 100 for n in range(101)]
    verdicts = [router.loses(share, 4096) for share in shares]
    assert not verdicts[0] and verdicts[-1]
    flips = sum(a != b for a, b in zip(verdicts, verdicts[1:]))
    assert flips == 1


def feed(router, tokens, overflow_pairs, calls):
    """`calls` batched calls of `tokens` tokens, each adding `overflow_pairs` to the counter it was handed (as
    the kernels would); returns how many ran on the kernels."""
    x = torch.zeros(tokens, 8)
    kernel_calls = 0
    for _ in range(calls):
        counter = router.overflow_counter(x, tokens)
        if counter is not None:
            counter += overflow_pairs
            router.after_kernel_call()
            kernel_calls += 1
    return kernel_calls


def test_router_routes_dense_after_a_heavy_window_then_measures_again():
    router = ActivityRouter(2048, 5632, 128, 29.0)
    tiles = router.tiles
    # light calls (1% of the pairs overflow): the kernels throughout
    assert feed(router, 4096, 4096 * tiles // 100, 3 * router.WINDOW) == 3 * router.WINDOW
    # every row heavy: one window measured on the kernels, read at the next call, then PROBE_EVERY dense
    assert feed(router, 4096, 4096 * tiles, router.WINDOW) == router.WINDOW
    assert feed(router, 4096, 4096 * tiles, router.PROBE_EVERY) == 0
    # then the kernels measure again: light now, so they stay
    assert feed(router, 4096, 0, router.WINDOW + 1) == router.WINDOW + 1
    assert feed(router, 4096, 0, 2 * router.WINDOW) == 2 * router.WINDOW


@pytest.mark.gpu
def test_gpu_router_reads_the_count_without_a_synchronization():
    """On CUDA the window's count comes back through a pinned copy read once its event has completed."""
    router = ActivityRouter(2048, 5632, 128, 29.0)
    x = torch.zeros(4096, 8, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(router.WINDOW):
            router.overflow_counter(x, 4096).add_(4096 * router.tiles)
            router.after_kernel_call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert router.overflow_counter(x, 4096) is None  # read: every row heavy, so dense
