"""The small-M linear layer (twell.small_linear; interpreter on CPU, bf16 on GPU) against the fp32 reference, and
against torch's F.linear on GPU."""
import pytest
import torch
import torch.nn.functional as F

from twell.launch import op_name
from twell.reference import small_linear_reference
from twell.small_linear import (MAX_GROUP, MAX_ROWS, small_linear, small_linear_fits, small_linear_grouped,
                                small_linear_grouped_fits, small_linear_wins)

from helpers import poison_allocations

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the kernel and the reference both round an fp32 sum to the output dtype; the sums differ by their order of
# addition, so an element may round one step apart (the relative bound of the whole output: a few such steps)
RELATIVE = {torch.float32: 1e-6, torch.float16: 1e-3}


def operands(lead, n, k, dtype, bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) / max(k, 1) ** 0.5
    b = torch.randn(n, generator=generator) if bias else None
    return x.to(DEV, dtype), weight.to(DEV, dtype), None if b is None else b.to(DEV, dtype)


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def assert_matches(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    assert relative_error(out, ref) < RELATIVE[out.dtype]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead,n,k,dtype", [
    ((1,), 64, 64, torch.float32),  # one token: products summed in FMAs, no tl.dot tile
    ((1, 1), 37, 1000, torch.float16),  # one token, N off the 8-row block, K over steps with a ragged last one
    ((1,), 300, 700, torch.float16),  # one token, 16-row blocks (300 rows: beyond the narrow grid), N off them
    ((MAX_ROWS,), 40, 100, torch.float32),  # the bound; N and K not multiples of the blocks
    ((2, 8), 300, 300, torch.float32),  # leading dimensions; wide blocks (300 rows fill the grid), K over 3 steps
    ((3,), 7, 5, torch.float16),  # fewer rows than a block, K under the dot's 16
    ((5,), 130, 1000, torch.float16),  # K over several steps with a ragged last one
    ((), 33, 48, torch.float16),  # x a single vector
])
def test_small_linear_matches_reference(lead, n, k, dtype, bias, monkeypatch):
    """NaN-poisoned outputs: every element written."""
    allocations = poison_allocations(monkeypatch, "twell.small_linear")
    x, weight, b = operands(lead, n, k, dtype, bias)
    out = small_linear(x, weight, b)
    assert out.shape == (*lead, n)
    assert_matches(out, small_linear_reference(x, weight, b))
    assert len(allocations) == 1


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,m,dtype", [
    ((64, 32, 32), 64, 1, torch.float32),  # q, k and v of grouped-query attention
    ((37, 5, 100), 70, 3, torch.float16),  # ragged blocks, one weight narrower than a block
    ((200, 24), 40, MAX_ROWS, torch.float32),  # two weights, wide blocks
])
def test_grouped_launch_matches_each_weight_alone(rows, k, m, dtype, bias, monkeypatch):
    """One launch writes every output whole (NaN-poisoned): each weight's rows, bias and output found by its
    block of the grid."""
    allocations = poison_allocations(monkeypatch, "twell.small_linear")
    x, _, _ = operands((m,), 1, k, dtype, False)
    weights, biases = zip(*(operands((1,), n, k, dtype, bias, seed=i + 1)[1:] for i, n in enumerate(rows)))
    outs = small_linear_grouped(x, weights, list(biases) if bias else None)
    assert len(allocations) == len(rows) and len(outs) == len(rows)
    for out, weight, b in zip(outs, weights, biases):
        assert_matches(out, small_linear_reference(x, weight, b))


def test_row_stride_and_empty_calls():
    x, weight, b = operands((4,), 24, 40, torch.float32, True)
    wide = torch.randn(4, 64, device=DEV)
    wide[:, :40] = x
    assert_matches(small_linear(wide[:, :40], weight, b), small_linear_reference(x, weight, b))
    assert small_linear(x[:0], weight, b).shape == (0, 24)  # no rows: no launch
    assert small_linear(x, weight[:0], b[:0]).shape == (4, 0)
    no_k = small_linear(x[:, :0], weight[:, :0], b)  # K = 0: the bias alone
    assert torch.equal(no_k, b.expand(4, 24))


def test_traced_calls_take_the_custom_op_and_eager_calls_skip_it():
    """The op's schema and fake outputs check out (opcheck); eager calls launch without it (its dispatch is host
    time), while a call under torch.compile (fullgraph: no graph break) and one under a dispatch mode go through
    it, with the eager outputs."""
    x, _, _ = operands((3,), 1, 40, torch.float32, False)
    weights, biases = zip(*(operands((1,), n, 40, torch.float32, True, seed=i + 1)[1:] for i, n in enumerate((24, 8))))
    weights, biases = list(weights), list(biases)
    op = getattr(torch.ops.twell, op_name("small_linear"))
    torch.library.opcheck(op, (x, weights, biases), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(op, (x, weights[:1], [None]), test_utils=("test_schema", "test_faketensor"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eager = small_linear_grouped(x, weights, biases)
    assert not [e.name for e in prof.events() if e.name.startswith("twell::")]
    graphs = []

    def backend(gm, example_inputs):  # records the graph, runs it as traced
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x: small_linear_grouped(x, weights, biases), backend=backend, fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert [node.target for node in graphs[0].graph.nodes if node.op == "call_function"].count(op.default) == 1
    for out, ref in zip(compiled, eager):
        assert torch.equal(out, ref)
    with torch._subclasses.FakeTensorMode() as mode:  # a dispatch mode must see the op (fake kernel)
        fake = small_linear(mode.from_tensor(x), mode.from_tensor(weights[0]))
    assert fake.shape == (3, 24)


def test_small_linear_refuses_what_it_does_not_take():
    x, weight, b = operands((4,), 24, 40, torch.float32, True)
    assert small_linear_fits(x, weight, b) and small_linear_grouped_fits(x, [weight, weight], [b, b])
    too_many_rows = operands((MAX_ROWS + 1,), 24, 40, torch.float32, False)[0]
    refused = [(too_many_rows, weight, None),
               (x, weight.half(), None),  # a dtype apart
               (x, weight, b.half()),
               (x, weight[:, :32], None),  # K apart
               (x, weight, b[:8]),  # a bias of another width
               (x, weight.t().contiguous().t(), None),  # a weight with a column stride
               (x.t().contiguous().t(), weight[:, :4], None),  # x with a column stride
               (x.long(), weight.long(), None)]  # no integer dot
    for args in refused:
        assert not small_linear_fits(*args)
        with pytest.raises(ValueError, match="small_linear"):
            small_linear(*args)
    grouped_refused = [([weight, weight], [b, None]),  # a bias on some weights only
                       ([weight] * (MAX_GROUP + 1), None), ([], None),
                       ([weight, weight[:, :32]], None)]
    for weights, biases in grouped_refused:
        assert not small_linear_grouped_fits(x, weights, biases)
        with pytest.raises(ValueError, match="small_linear"):
            small_linear_grouped(x, weights, biases)


@pytest.mark.parametrize("m,rows,k,wins", [
    (8, [2560, 1024, 1024], 2560, True),  # a grouped launch replaces three of cuBLAS's
    (1, [1536], 8960, False), (1, [1024], 2048, True),  # K at most twice N
    (1, [2560], 4096, True),  # one row: 320 programs of 8 rows
    (1, [14336], 8192, True), (1, [16384], 16384, False),  # 896 / 1024 programs of 16 rows: 924 resident at once
    (8, [2560], 4096, False),  # 160 programs of 16 rows on 132 SMs: beyond one round
    (8, [4096], 4096, False), (16, [5120], 5120, False), (2, [8192], 8192, False),  # 256, 320, 512 programs
    (8, [2048], 2048, True), (2, [896], 896, True),  # one round
    (8, [9216], 3072, True), (16, [12288], 4096, True),  # 288 and 384 programs of 32 rows
])
def test_small_linear_wins_where_its_grid_fills_the_gpu(m, rows, k, wins):
    """The rule the modeling file routes a decode-size projection by, on a GPU of 132 SMs."""
    assert small_linear_wins(m, rows, k, sms=132) is wins


GPU_SHAPES = [(2048, 2048), (256, 2048), (8960, 1536), (1536, 8960), (1000, 1000)]  # (N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, MAX_ROWS])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_bf16_small_linear_against_torch(n, k, m):
    """bf16 at decode shapes: as close to the fp32 reference as torch's F.linear (cuBLAS, fp32 accumulation)
    is, both rounding an fp32 sum to bf16."""
    x, weight, b = operands((m,), n, k, torch.bfloat16, True)
    exact = x.float() @ weight.float().t() + b.float()
    ours, torch_error = relative_error(small_linear(x, weight, b), exact), relative_error(F.linear(x, weight, b), exact)
    assert ours < 1.5 * torch_error + 1e-4
    assert relative_error(small_linear(x, weight), x.float() @ weight.float().t()) < 1.5 * torch_error + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("rows,k", [((2048, 2048, 2048), 2048), ((1536, 256, 256), 1536), ((1536, 1536, 1536), 1536)])
def test_gpu_grouped_launch_replays_in_a_cuda_graph(rows, k, m):
    """q, k and v in one launch, captured in a CUDA graph (warmed up first, as a decode step is): its replays
    follow new values of the captured input, as close to the reference as F.linear's."""
    x, _, _ = operands((m,), 1, k, torch.bfloat16, False)
    weights, biases = zip(*(operands((1,), n, k, torch.bfloat16, True, seed=i + 1)[1:] for i, n in enumerate(rows)))
    small_linear_grouped(x, weights, biases)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = small_linear_grouped(x, weights, biases)
    for seed in (1, 2):
        x.copy_(operands((m,), 1, k, torch.bfloat16, False, seed=100 + seed)[0])
        graph.replay()
        for out, weight, b in zip(outs, weights, biases):
            exact = x.float() @ weight.float().t() + b.float()
            assert relative_error(out, exact) < 1.5 * relative_error(F.linear(x, weight, b), exact) + 1e-4
