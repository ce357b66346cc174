"""e4m3 up and down rows (fp8_gate.quantize_up_down, gated_mlp's up_down_fp8) against their references. CPU:
Triton interpreter, fp16 x (the interpreter has no bf16 arithmetic), tiny shapes off the block sizes, the batched
path with empty, heavy and overflowing rows, with and without the fp8 gate, NaN-poisoned buffers (from any token
count: `walk_every_batched_call`); decode sizes and batched calls where paths.reads_fp8_up_down says the e4m3 walk
loses read up and down themselves. GPU (-m gpu): bf16 at real sizes, CUDA graphs and torch.compile."""
import json
import sys
from pathlib import Path

import pytest
import torch

import twell
from twell.fp8_gate import E4M3, quantize_up_down, quantize_weight, up_down_reference
from twell.batched import walk_row_bytes
from twell.format import HEAVY_UNITS
from twell.launch import op_name
from twell.paths import launch_path, reads_fp8_up_down
from twell.reference import forward_reference

from helpers import batched_from, load_benchmark
from test_twell_gated_mlp import DEV, assert_rows_close, block, random_case, random_rows_block
from test_twell_gated_mlp import poisoned_outputs  # noqa: F401  (a fixture: `poisoned` extends it)
from test_twell_fp8_gate import poisoned  # noqa: F401  (a fixture)

paths = sys.modules["twell.paths"]


@pytest.fixture
def walk_every_batched_call(monkeypatch):
    """The batched path walks the e4m3 rows at the interpreter's small shapes too."""
    monkeypatch.setattr(paths, "UP_DOWN_FP8_MIN_ROW_BYTES", 0)


def test_quantize_up_down_keeps_a_scale_a_unit():
    """Row j of each copy is unit j's up row or down column at its largest magnitude over 448."""
    torch.manual_seed(0)
    up = torch.randn(6, 40) * torch.logspace(-3, 2, 6)[:, None]
    down = torch.randn(40, 6) * torch.logspace(2, -3, 6)[None, :]
    copies = quantize_up_down(up, down)
    assert copies.up.dtype == copies.down_t.dtype == E4M3 and copies.up.shape == copies.down_t.shape == (6, 40)
    assert copies.down_t.is_contiguous() and copies.up_scale.shape == copies.down_scale.shape == (6,)
    assert torch.equal(copies.up.float().abs().amax(1), torch.full((6,), 448.0))
    assert torch.equal(copies.down_t.float(), quantize_weight(down.t())[0].float())
    up_q, down_q = up_down_reference(copies)
    assert up_q.shape == up.shape and down_q.shape == down.shape
    assert torch.allclose(up_q, up, rtol=2 ** -4, atol=0) and torch.allclose(down_q, down, rtol=2 ** -4, atol=0)
    with pytest.raises(ValueError, match=r"\[D, I\]"):
        quantize_up_down(up, down.t())


def expected(x, gate, up, down, tile, comp, gate_fp8=None, up_down_fp8=None):
    return twell.gated_mlp_reference(x.float(), gate, up, down, gate_fp8=gate_fp8, tile=tile, compression=comp,
                                     up_down_fp8=up_down_fp8).float()


@pytest.mark.parametrize("with_fp8_gate", [False, True])
@pytest.mark.parametrize("draw", [0, 1])
def test_random_shapes_walk_the_e4m3_rows(draw, with_fp8_gate, poisoned, walk_every_batched_call):
    """test_twell_gated_mlp's random batched shapes (empty, dense and overflowing rows), fp16, given e4m3 up and
    down rows: every row against the reference that mixes them as the kernels do, the empty row exactly zero,
    the four-element counter as forward_reference counts it; the rows walked differ from the plain block's."""
    m, d, i, tile, comp, s, k, _, _ = random_case("batched", draw)
    torch.manual_seed(draw)
    x, gate, up, down = (v.to(torch.float16) for v in random_rows_block(m, d, i, tile, s, k))
    up_down = quantize_up_down(up, down)
    gate_fp8 = quantize_weight(gate) if with_fp8_gate else None
    overflow = torch.zeros(4, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, overflow=overflow, gate_fp8=gate_fp8,
                          up_down_fp8=up_down)
    assert out.shape == x.shape and out.dtype == x.dtype and (m, d) in poisoned
    mixed = expected(x, gate, up, down, tile, comp, gate_fp8, up_down)
    assert_rows_close(out, mixed, 3e-3)
    assert (out[0] == 0).all()
    counted = torch.zeros(4, dtype=torch.int64)
    forward_reference(x.cpu(), gate.cpu(), up.cpu(), down.cpu(), tile, comp, counted,
                      None if gate_fp8 is None else tuple(t.cpu() for t in gate_fp8))
    assert overflow.tolist() == counted.tolist()
    plain = expected(x, gate, up, down, tile, comp, gate_fp8)
    assert not torch.allclose(mixed, plain, rtol=1e-3, atol=1e-3)


def test_fallbacks_read_up_and_down_themselves(poisoned, walk_every_batched_call):
    """The dense fallbacks read up and down in x's dtype: the heavy last row (every unit active) equals the plain
    block's reference; row 2, with one tile beyond its slots and three units walked beyond it, matches the mixed
    reference and neither the plain nor the all-e4m3 block; every row matches the mixed reference."""
    m, d, i, tile, comp = 70, 48, 300, 32, 4
    s = 8  # slots(32, 4)
    torch.manual_seed(3)
    x, gate, up, down = (v.to(torch.float16) for v in random_rows_block(m, d, i, tile, s, k=6))
    up_down = quantize_up_down(up, down)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, up_down_fp8=up_down)
    mixed = expected(x, gate, up, down, tile, comp, up_down_fp8=up_down)
    plain = expected(x, gate, up, down, tile, comp)
    up_q, down_q = up_down_reference(up_down)
    all_e4m3 = (torch.relu(x.float() @ gate.float().t()) * (x.float() @ up_q.t())).half().float() @ down_q.t()
    assert_rows_close(out, mixed, 3e-3)
    assert torch.equal(mixed[-1], plain[-1])
    for other in (plain, all_e4m3):
        assert not torch.allclose(mixed[2], other[2], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("path", ["tile-out", "decode 3-16", "decode 17-64"])
def test_decode_sizes_read_up_and_down_themselves(path, poisoned):
    """Where a call takes a decode path, the e4m3 rows go unread: the output equals the plain call's."""
    m, d, i, tile, comp, s, k, _, _ = random_case(path, 0)
    torch.manual_seed(1)
    x, gate, up, down = (v.to(torch.float16) for v in random_rows_block(m, d, i, min(tile, 64), s, k))
    assert not reads_fp8_up_down(m, d, i) and launch_path(m, d, i).name != "batched"
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, up_down_fp8=quantize_up_down(up, down))
    assert torch.equal(out, twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp))


def test_batched_calls_the_rule_refuses_read_up_and_down_themselves(monkeypatch):
    """A batched call whose out kernel's threads would load fewer than UP_DOWN_FP8_MIN_ROW_BYTES of a row gives the
    plain call's output; with the rule's bound at its row bytes, the mixed reference's."""
    torch.manual_seed(2)
    x, gate, up, down = block(80, 40, 200, k=5, dtype=torch.float16)
    up_down = quantize_up_down(up, down)
    assert launch_path(80, 40, 200).name == "batched" and not reads_fp8_up_down(80, 40, 200)
    out = twell.gated_mlp(x, gate, up, down, tile=32, up_down_fp8=up_down)
    assert torch.equal(out, twell.gated_mlp(x, gate, up, down, tile=32))
    monkeypatch.setattr(paths, "UP_DOWN_FP8_MIN_ROW_BYTES", walk_row_bytes(80, 40))
    assert reads_fp8_up_down(80, 40, 200)
    out = twell.gated_mlp(x, gate, up, down, tile=32, up_down_fp8=up_down)
    assert_rows_close(out, expected(x, gate, up, down, 32, 8, up_down_fp8=up_down), 3e-3)


def measured_cells():
    """(tokens, D, I, the block's speed-up with e4m3 up and down rows, with bf16 ones) of every committed H200 run of
    bench_inference.py --fp8-up-down whose rows the out kernel walks (fewer than HEAVY_UNITS units a row)."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for name in ("inference_fp8_up_down_h200.json", "inference_fp8_up_down_h200_repeat1.json",
                 "inference_mid_fp8_up_down_h200.json", "inference_real_fp8_up_down_h200.json",
                 "inference_ud8_threshold_h200.json"):
        for row in json.loads((results / name).read_text())["rows"]:
            if "speedup_ud8" in row and row["k"] < HEAVY_UNITS:
                yield row["M"], row["D"], row["I"], row["speedup_ud8"], row["speedup"]


def test_the_rule_reads_e4m3_rows_where_they_were_measured_to_win():
    """paths.reads_fp8_up_down against the measurements: every cell it takes walked the e4m3 rows at least as fast
    as the bf16 ones (within 1%), every cell it refuses slower; cells on both sides at D 896 and 2048."""
    cells = list(measured_cells())
    taken = [cell for cell in cells if reads_fp8_up_down(*cell[:3])]
    refused = [cell for cell in cells if not reads_fp8_up_down(*cell[:3])]
    assert all(ud8 >= 0.99 * bf16 for *_, ud8, bf16 in taken) and all(ud8 < bf16 for *_, ud8, bf16 in refused)
    assert {cell[1] for cell in refused} == {896, 2048} and {cell[1] for cell in taken} >= {896, 2048, 3584, 4096}


def test_e4m3_rows_are_checked():
    x, gate, up, down = block(80, 32, 64, k=4, dtype=torch.float16)
    good = quantize_up_down(up, down)
    cases = [((up, down), "UpDownE4m3"),
             (good._replace(up=good.up[:-1]), "up's"),
             (good._replace(down_t=good.down_t.t().contiguous().t()), "contiguous"),
             (good._replace(down_t=good.up.float()), "down's transposed"),
             (good._replace(up_scale=good.up_scale[:-1]), "a scale a unit"),
             (good._replace(down_scale=good.down_scale.double()), "float32")]
    for up_down, message in cases:
        with pytest.raises(ValueError, match=message):
            twell.gated_mlp(x, gate, up, down, tile=16, up_down_fp8=up_down)
    with pytest.raises(ValueError, match="16-bit x"):
        twell.gated_mlp(x.float(), gate.float(), up.float(), down.float(), tile=16, up_down_fp8=good)
    with pytest.raises(ValueError, match="precision 'default'"):
        twell.gated_mlp(x, gate, up, down, tile=16, precision="highest", up_down_fp8=good)


def test_custom_ops_take_the_e4m3_rows(walk_every_batched_call, monkeypatch):
    """The traced path: both custom ops take the e4m3 rows beside the fp8 gate's tensors, positional or by name
    (as torch.compile's graphs call them), and give the eager call's output."""
    torch.manual_seed(0)
    batched_from(monkeypatch, "twell.gated_mlp", 9)
    x, gate, up, down = block(9, 16, 32, k=5, dtype=torch.float16)  # the batched path
    gate_fp8, up_down = quantize_weight(gate), quantize_up_down(up, down)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    op = getattr(torch.ops.twell, op_name("gated_mlp_overflow"))
    torch.library.opcheck(op, (x, gate, up, down, 16, 4, "default", overflow, *gate_fp8, *up_down),
                          test_utils=("test_faketensor",))
    eager = twell.gated_mlp(x, gate, up, down, tile=16, gate_fp8=gate_fp8, up_down_fp8=up_down)
    assert not torch.equal(eager, twell.gated_mlp(x, gate, up, down, tile=16, gate_fp8=gate_fp8))  # rows read
    traced = getattr(torch.ops.twell, op_name("gated_mlp"))(x, gate, up, down, 16, 8, "default", *gate_fp8,
                                                             *up_down)
    assert torch.equal(traced, eager)
    names = ("gate_fp8_weight", "gate_fp8_scale", "up_fp8", "down_t_fp8", "up_fp8_scale", "down_fp8_scale")
    by_name = getattr(torch.ops.twell, op_name("gated_mlp"))(x, gate, up, down, 16, 8, "default",
                                                              **dict(zip(names, (*gate_fp8, *up_down))))
    assert torch.equal(by_name, eager)


def real_block(m, k=29):
    x, gate, up, down = block(m, 2048, 5632, k=k, dtype=torch.bfloat16)
    return x, gate, up, twell.prepare_down(down), quantize_up_down(up, down)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 4096, 16384])
@pytest.mark.parametrize("with_fp8_gate", [False, True])
def test_gpu_e4m3_rows_real_shapes(m, with_fp8_gate):
    """The 1.5B shape, bf16: batched, every row within bf16 rounding of the mixed reference, the whole block
    within 1.5e-2 of it and several times closer to it than to the plain block; decode sizes bit for bit the
    plain call's."""
    torch.manual_seed(m)
    x, gate, up, down, up_down = real_block(m)
    gate_fp8 = quantize_weight(gate) if with_fp8_gate else None
    out = twell.gated_mlp(x, gate, up, down, gate_fp8=gate_fp8, up_down_fp8=up_down)
    if not reads_fp8_up_down(m, 2048, 5632):
        assert torch.equal(out, twell.gated_mlp(x, gate, up, down, gate_fp8=gate_fp8))
        return
    rows = slice(0, 4096)
    mixed = expected(x[rows], gate, up, down, 128, 8, gate_fp8, up_down)
    assert_rows_close(out[rows], mixed, 5e-2)
    plain = expected(x[rows], gate, up, down, 128, 8, gate_fp8)
    error = ((out[rows].float() - mixed).norm() / mixed.norm()).item()
    assert error < 1.5e-2 and error < ((out[rows].float() - plain).norm() / plain.norm()).item() / 3


@pytest.mark.gpu
def test_gpu_e4m3_rows_under_cuda_graphs_and_compile():
    """A CUDA graph replays the eager call's output; torch.compile (through the custom op) gives it too."""
    torch.manual_seed(0)
    x, gate, up, down, up_down = real_block(4096)
    eager = twell.gated_mlp(x, gate, up, down, up_down_fp8=up_down)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = twell.gated_mlp(x, gate, up, down, up_down_fp8=up_down)
    graph.replay()
    assert torch.equal(captured, eager)
    compiled = torch.compile(lambda v: twell.gated_mlp(v, gate, up, down, up_down_fp8=up_down), fullgraph=True)
    assert torch.equal(compiled(x), eager)


def test_the_modeling_layer_reads_both_copies_and_remakes_them_after_the_weights_change(monkeypatch):
    """TwellGatedMLP with use_fp8_gate() and use_fp8_up_down(): a batched kernel call computes the block as the two
    references mix them, from the current weights; the copies are remade once up or down change in place; off
    again, the plain kernels."""
    modeling = load_benchmark("inference_robustness.py").runtime()  # the files a checkpoint carries
    runtime_paths = sys.modules[modeling.reads_fp8_up_down.__module__]
    monkeypatch.setattr(runtime_paths, "UP_DOWN_FP8_MIN_ROW_BYTES", 0)  # walk at the interpreter's shapes
    monkeypatch.setattr(modeling.ActivityRouter, "loses", lambda self, *measured: False)  # half the units fire
    original = torch.nn.Module()
    for name, shape in (("gate_proj", (96, 40)), ("up_proj", (96, 40)), ("down_proj", (40, 96))):
        original.add_module(name, torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.float16))
    # compression 1: no tile overflows, so no unit near zero can move a tile between the walk and the fallback
    mlp = modeling.TwellGatedMLP(original, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                                 modeling.LayerPlan("sparse", 32, 1, ((1, 128),)))
    batched_from(monkeypatch, modeling.__name__, 8)
    x = torch.randn(12, 40, dtype=torch.float16)  # the batched path
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    with torch.no_grad():
        mlp.use_fp8_gate()
        mlp.use_fp8_up_down()
        for changed in (mlp.up_proj.weight, mlp.down_proj.weight, None):
            mixed = expected(x, *weights, 32, 1, quantize_weight(weights[0]), quantize_up_down(weights[1], weights[2]))
            assert_rows_close(mlp(x[None])[0], mixed, 3e-3)
            if changed is not None:
                changed.mul_(-1.5)
        mlp.use_fp8_up_down(False)
        mlp.use_fp8_gate(False)
        assert_rows_close(mlp(x[None])[0], expected(x, *weights, 32, 1), 3e-3)
