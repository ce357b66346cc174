"""Which path eager calls take (twell.routing): short calls dense, long ones on the kernels unless their measured
activity predicts a loss."""
import pytest
import torch

from twell.cost_model import dense_time
from twell.format import UNIT_SAMPLE
from twell.routing import EAGER_MIN_DENSE_S, ActivityRouter, eager_dense, short_prefill


def test_eager_dense_where_the_dense_block_is_short():
    """Eager calls run dense up to where the dense block's predicted time reaches EAGER_MIN_DENSE_S: between
    4096 and 16384 tokens at D 2048 / I 5632, from fewer tokens on a wider layer."""
    assert eager_dense(1, 2048, 5632) and eager_dense(4096, 2048, 5632) and not eager_dense(16384, 2048, 5632)
    first = next(n for n in range(1, 1 << 17) if not eager_dense(n, 2048, 5632))
    assert dense_time(2048, 5632, first) >= EAGER_MIN_DENSE_S > dense_time(2048, 5632, first - 1)
    assert next(n for n in range(1, 1 << 17) if not eager_dense(n, 4096, 14336)) < first


def test_loses_where_heavy_rows_or_busier_rows_outweigh_the_saving():
    """The cost model's verdict at D 2048 / I 5632, 29 active units: no heavy rows win at 4096 tokens, every
    row heavy loses, and the verdict flips once between."""
    router = ActivityRouter(2048, 5632, 29.0, torch.device("cpu"))
    shares = [n / 100 for n in range(101)]
    verdicts = [router.loses(share, 4096, 29.0) for share in shares]
    assert not verdicts[0] and verdicts[-1]
    flips = sum(a != b for a, b in zip(verdicts, verdicts[1:]))
    assert flips == 1
    # no heavy rows, but every row several times the calibration's activity: a loss too
    assert not router.loses(0.0, 16384, 29.0) and router.loses(0.0, 16384, 3 * 29.0)


def feed(router, tokens, heavy_rows, calls, active=29):
    """`calls` batched calls of `tokens` tokens, each adding `heavy_rows`, and the sampled rows' `active`
    units a row, to the counter it was handed (as the kernels would); returns how many ran on the kernels."""
    x = torch.zeros(tokens, 8)
    sampled = (tokens - heavy_rows) // UNIT_SAMPLE
    kernel_calls = 0
    for _ in range(calls):
        counter = router.overflow_counter(x, tokens)
        if counter is not None:
            counter += torch.tensor([0, active * sampled, sampled, heavy_rows])
            router.after_kernel_call()
            kernel_calls += 1
    return kernel_calls


def test_router_routes_dense_after_a_heavy_window_then_measures_again():
    router = ActivityRouter(2048, 5632, 29.0, torch.device("cpu"))
    # light calls (1% of the rows heavy): the kernels throughout
    assert feed(router, 4096, 41, 3 * router.WINDOW) == 3 * router.WINDOW
    # every row heavy: one window measured on the kernels, read at the next call, then PROBE_EVERY dense
    assert feed(router, 4096, 4096, router.WINDOW) == router.WINDOW
    assert feed(router, 4096, 4096, router.PROBE_EVERY) == 0
    # then the kernels measure again: light now, so they stay
    assert feed(router, 4096, 0, router.WINDOW + 1) == router.WINDOW + 1
    assert feed(router, 4096, 0, 2 * router.WINDOW) == 2 * router.WINDOW


def test_router_routes_dense_when_every_row_is_more_active_than_planned():
    router = ActivityRouter(2048, 5632, 29.0, torch.device("cpu"))
    assert feed(router, 16384, 0, 3 * router.WINDOW, active=35) == 3 * router.WINDOW  # a little more: kernels
    assert feed(router, 16384, 0, router.WINDOW + 1, active=100) == router.WINDOW  # 3.4x: dense after a window


class PendingEvent:
    """A window's copy that the GPU has not reached: `query` says so until the host waits for it."""

    def __init__(self):
        self.waits = 0

    def query(self):
        return self.waits > 0

    def synchronize(self):
        self.waits += 1


def test_router_waits_for_a_heavy_verdict_after_ahead_calls():
    """While a window's count travels, AHEAD more calls take the kernels; the next one waits for the count and
    runs dense (a host far ahead of the GPU does not issue a stream of heavy calls on the kernels)."""
    router = ActivityRouter(2048, 5632, 29.0, torch.device("cpu"))
    x = torch.zeros(4096, 8)
    for _ in range(router.WINDOW):  # every row heavy
        router.overflow_counter(x, 4096)[3] += 4096
        router.after_kernel_call()
    router.event = PendingEvent()
    assert feed(router, 4096, 4096, router.AHEAD) == router.AHEAD and router.event.waits == 0
    assert feed(router, 4096, 4096, 1) == 0 and router.event.waits == 1


@pytest.mark.gpu
def test_gpu_router_reads_the_count_without_a_synchronization():
    """On CUDA the window's count comes back through a pinned copy read once its event has completed."""
    x = torch.zeros(4096, 8, device="cuda")
    router = ActivityRouter(2048, 5632, 29.0, x.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(router.WINDOW):
            router.overflow_counter(x, 4096)[3].add_(4096)
            router.after_kernel_call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the window's copy has landed: the read that follows must not wait either
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert router.overflow_counter(x, 4096) is None  # read: every row heavy, so dense
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_short_prefills_run_dense_and_decode_steps_keep_the_kernels():
    """A call of several tokens a sequence up to the decode rows is a short prefill (its first tokens are
    heavy); one token a sequence, 2-D rows and calls past the decode rows are not."""
    from twell.format import decode_rows

    small, large = (2048, 5632), (4096, 14336)
    rows = decode_rows(*small)
    assert short_prefill(torch.Size([1, 2, 8]), *small) and short_prefill(torch.Size([4, rows // 4, 8]), *small)
    assert not short_prefill(torch.Size([1, rows + 1, 8]), *small)
    assert not short_prefill(torch.Size([rows, 1, 8]), *small)  # a decode step of many sequences
    assert not short_prefill(torch.Size([rows, 8]), *small)  # rows without sequences
    assert decode_rows(*large) < rows
    assert not short_prefill(torch.Size([1, decode_rows(*large) + 1, 8]), *large)


def test_decode_path_ends_earlier_at_large_and_wide_layers():
    """Up to 64 rows; 16 where D * I > 2^24; 32 where I holds more decode tiles than an H100 or H200 has SMs (a
    second round of gate programs above 16 rows)."""
    from twell.format import decode_rows

    assert [decode_rows(*shape) for shape in ((2048, 5632), (2048, 8192), (1536, 8448), (1536, 8960),
                                              (1024, 16384), (4096, 14336), (2048, 8448))] == [64, 64, 64, 32, 32, 16, 16]


def test_router_judges_a_window_without_sampled_rows_at_the_planned_activity(monkeypatch):
    """Where every row of a window was heavy, no row was sampled for its units: the verdict takes the plan's
    mean active units for the others."""
    router = ActivityRouter(2048, 5632, 29.0, torch.device("cpu"))
    verdicts = []
    monkeypatch.setattr(ActivityRouter, "loses", lambda self, *measured: verdicts.append(measured) or False)
    assert feed(router, 4096, 4096, router.WINDOW + 1) == router.WINDOW + 1
    assert verdicts == [(1.0, 4096.0, 29.0)]


@pytest.mark.gpu
def test_gpu_modeling_file_runs_short_prefills_and_short_eager_calls_dense(tmp_path, monkeypatch):
    """On a GPU the modeling file keeps the kernels off a captured prefill of a few tokens a sequence (heavy
    first tokens, `short_prefill`) and off an eager call whose dense block is short (`eager_dense`); a captured
    decode step and a captured call past the decode rows take them."""
    from transformers import AutoModelForCausalLM

    from sparsify.export import export_checkpoint
    from test_export import PLAN, TRAINING, _relufied, _remote_module
    from twell.format import decode_rows

    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).cuda()
    module, mlp = _remote_module(remote), remote.model.layers[0].mlp
    kernel, calls = module.gated_mlp, []
    monkeypatch.setattr(module, "gated_mlp",
                        lambda x, *a, **k: calls.append(tuple(x.shape[:-1])) or kernel(x, *a, **k))
    d = remote.config.hidden_size
    rows = decode_rows(d, mlp.width)

    def captured(shape):
        x = torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16)
        mlp(x)  # warm-up outside the capture (Triton compiles, the graphs' pool)
        calls.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            mlp(x)

    with torch.no_grad():
        captured((2, 5))
        assert calls == []
        captured((4, 1))
        assert calls == [(4, 1)]
        captured((1, rows + 16))
        assert calls == [(1, rows + 16)]
        calls.clear()
        mlp(torch.randn(1, rows + 16, d, device="cuda", dtype=torch.bfloat16))  # eager: host-bound, dense
        assert calls == []
