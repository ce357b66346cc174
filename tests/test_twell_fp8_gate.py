"""The fp8 gate (twell.fp8_gate, gated_mlp's gate_fp8) against its references. CPU: Triton interpreter, fp16 x
(the interpreter has no bf16 arithmetic), tiny shapes off the block sizes, every launch path with empty, dense
(overflowing) and heavy rows, NaN-poisoned buffers. GPU (-m gpu): bf16 at real sizes, the Hopper gate kernel
against the Triton one, CUDA graphs and torch.compile."""
import math
import sys

import pytest
import torch

import twell
from twell.fp8_gate import E4M3, gate_reference, quantize_rows, quantize_rows_reference, quantize_weight
from twell.format import slots
from twell.launch import op_name, sm_count
from twell.decode import decode_tile_stride
from twell.paths import launch_path
from twell.reference import forward_reference, gate_values, tile_counts

from helpers import PoisonedTorch, batched_from, load_benchmark
from test_twell_gated_mlp import DEV, assert_rows_close, block, random_case, random_rows_block
from test_twell_gated_mlp import poisoned_outputs  # noqa: F401  (a fixture: `poisoned` extends it)

gh = sys.modules["twell.gate_hopper"]


@pytest.fixture
def poisoned(poisoned_outputs, monkeypatch):
    """test_twell_gated_mlp's poisoned buffers, and fp8_gate.py's (the quantized x and its scales)."""
    monkeypatch.setattr(sys.modules["twell.fp8_gate"], "torch", PoisonedTorch(poisoned_outputs))
    return poisoned_outputs


@pytest.mark.parametrize("m,d,dtype", [(1, 40, torch.float16), (7, 33, torch.float32), (70, 2048, torch.float16),
                                       (3, 5000, torch.float16)])
def test_quantize_rows_matches_its_reference_exactly(m, d, dtype, poisoned):
    """Every value and scale equal to the reference's, over rows of magnitudes 1e-8 to 1e3, a zero row and
    a strided x; ties and roundings that carry into the exponent included (the interpreter's own cast gets
    those wrong)."""
    torch.manual_seed(m)
    x = (torch.randn(m, 2 * d, device=DEV) * torch.logspace(-8, 3, m, device=DEV)[:, None]).to(dtype)[:, ::2]
    x[0] = 0
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert q.dtype == E4M3 and q.is_contiguous() and (m, d) in poisoned
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(scale, scale_ref)
    assert (q[0].float() == 0).all() and scale[0] > 0
    # dequantized, each row is within e4m3's rounding (2^-4 of a value, 2^-9 of the row's largest below 2^-6)
    back = q.float() * scale[:, None]
    bound = x.float().abs() * 2 ** -4 + x.float().abs().amax(1, keepdim=True) * 2 ** -9 / 448 * 64
    assert (back - x.float()).abs().le(bound).all()


def test_quantize_weight_scales_each_unit_by_its_largest_magnitude():
    w = torch.randn(5, 33) * torch.tensor([1e-3, 1.0, 100.0, 0.0, 7.0])[:, None]
    q, scale = quantize_weight(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (5,)
    assert torch.equal(q.float().abs().amax(1)[[0, 1, 2, 4]], torch.full((4,), 448.0)) and (q[3].float() == 0).all()
    assert torch.allclose(q.float() * scale[:, None], w, rtol=2 ** -4, atol=1e-30)


def fp8_expected(x, gate, up, down, gate_fp8, tile, comp, path):
    """The block's reference given the fp8 gate, as `path` computes g: the batched path's with it (its fallbacks
    in x's dtype), the decode paths' without (they read the gate itself)."""
    return twell.gated_mlp_reference(x.float(), gate, up, down, gate_fp8=gate_fp8 if path == "batched" else None,
                                     tile=tile, compression=comp).float()


@pytest.mark.parametrize("draw", [0, 1])
@pytest.mark.parametrize("path", ["tile-out", "decode 3-16", "decode 17-64", "batched"])
def test_random_shapes_with_the_fp8_gate(path, draw, poisoned):
    """test_twell_gated_mlp's random shapes of each path, fp16, given the fp8 gate: every row against the
    reference of g as the path computes it (decode paths: from the gate itself), the empty row exactly zero, the
    overflow counted as forward_reference counts it from the fp8 g (batched) or the tiles beyond their slots
    (decode). NaN-poisoned."""
    m, d, i, tile, comp, s, k, _, _ = random_case(path, draw)
    torch.manual_seed(draw)
    batched = path == "batched"
    t = tile if batched else min(tile, 64)
    ts = t if batched else decode_tile_stride(i, t, m, sm_count(torch.device(DEV)) if DEV == "cuda" else None)
    x, gate, up, down = (v.to(torch.float16) for v in random_rows_block(m, d, i, ts, s, k))
    gate_fp8 = quantize_weight(gate)
    overflow = torch.zeros(4 if batched else 1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, overflow=overflow, gate_fp8=gate_fp8)
    assert out.shape == x.shape and out.dtype == x.dtype and (m, d) in poisoned
    name = launch_path(m, d, i).name
    assert_rows_close(out, fp8_expected(x, gate, up, down, gate_fp8, ts, comp, name), 3e-3)
    if m > 1:
        assert (out[0] == 0).all()
    if batched:
        expected = torch.zeros(4, dtype=torch.int64)
        forward_reference(x.cpu(), gate.cpu(), up.cpu(), down.cpu(), tile, comp, expected,
                          tuple(t.cpu() for t in gate_fp8))
        assert overflow.tolist() == expected.tolist()
    else:
        assert overflow.item() == (tile_counts(gate_values(x, gate), ts) > s).sum().item()


def test_batched_fallbacks_compute_g_from_the_gate_itself(poisoned):
    """On the batched path the dense fallbacks (a heavy row, a tile beyond its slots) read the gate in x's
    dtype: their rows match that reference and not the all-fp8 one; the other rows match the fp8 gate's."""
    torch.manual_seed(3)
    m, d, i, tile, comp = 70, 48, 300, 32, 4
    x, gate, up, down = block(m, d, i, k=6, dtype=torch.float16)
    x[5, 0] = -40.0  # every unit active: heavy
    gate_fp8 = quantize_weight(gate)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, gate_fp8=gate_fp8)
    mixed = fp8_expected(x, gate, up, down, gate_fp8, tile, comp, "batched")
    all_fp8 = (torch.relu(gate_reference(x, *gate_fp8)) * (x.float() @ up.float().t())) @ down.float().t()
    assert_rows_close(out, mixed, 3e-3)
    assert torch.equal(mixed[5], twell.gated_mlp_reference(x.float(), gate, up, down)[5])
    assert not torch.allclose(out[5].float(), all_fp8[5], rtol=1e-3)


def test_the_fp8_gate_is_checked():
    x, gate, up, down = block(4, 32, 64, k=4, dtype=torch.float16)
    weight, scale = quantize_weight(gate)
    cases = [((gate, scale), "the gate's torch.float8_e4m3fn copy"),
             ((weight[:-1], scale), "shape"),
             ((weight, scale[:-1]), "a scale a unit"),
             ((weight, scale.double()), "float32")]
    for gate_fp8, message in cases:
        with pytest.raises(ValueError, match=message):
            twell.gated_mlp(x, gate, up, down, tile=16, gate_fp8=gate_fp8)
    with pytest.raises(ValueError, match="16-bit x"):
        twell.gated_mlp(x.float(), gate.float(), up.float(), down.float(), tile=16, gate_fp8=(weight, scale))


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    """Triton has no e4m3 dot below compute capability 8.9: such a GPU gets a clear error, not a compiler's."""
    from twell import fp8_gate

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"fp8 tensor cores .*A100-SXM4-80GB is 8\.0"):
        fp8_gate.check_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8_gate.check_device(torch.device("cuda", 0))
    fp8_gate.check_device(torch.device("cpu"))


def test_custom_ops_take_the_fp8_gate():
    """The traced path: both custom ops take the fp8 gate's tensors (their fake implementation; opcheck's schema
    test compares fp8 tensors with an op that CPU torch lacks), and give the eager call's output."""
    torch.manual_seed(0)
    x, gate, up, down = block(3, 16, 32, k=5, dtype=torch.float16)
    weight, scale = quantize_weight(gate)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    op = getattr(torch.ops.twell, op_name("gated_mlp_overflow"))
    torch.library.opcheck(op, (x, gate, up, down, 16, 4, "default", overflow, weight, scale),
                          test_utils=("test_faketensor",))
    eager = twell.gated_mlp(x, gate, up, down, tile=16, gate_fp8=(weight, scale))
    assert torch.equal(getattr(torch.ops.twell, op_name("gated_mlp"))(x, gate, up, down, 16, 8, "default", weight,
                                                                       scale), eager)


def test_the_modeling_layer_reads_the_fp8_copy_and_remakes_it_after_the_weight_changes(monkeypatch):
    """TwellGatedMLP.use_fp8_gate: a batched kernel call computes g as the fp8 gate does from the current weight;
    the copy is remade once the weight changes in place (gate_e4m3() gives the one it reads); off again, none and
    the plain kernels."""
    modeling = load_benchmark("inference_robustness.py").runtime()  # the files a checkpoint carries
    original = torch.nn.Module()
    for name, shape in (("gate_proj", (96, 40)), ("up_proj", (96, 40)), ("down_proj", (40, 96))):
        original.add_module(name, torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.float16))
    mlp = modeling.TwellGatedMLP(original, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                                 modeling.LayerPlan("sparse", 32, 4, ((1, 128),)))
    batched_from(monkeypatch, modeling.__name__, 8)
    x = torch.randn(1, 12, 40, dtype=torch.float16)  # the batched path
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    with torch.no_grad():
        mlp.use_fp8_gate()
        for _ in range(2):  # the second time after the gate weight changed in place
            expected = twell.gated_mlp_reference(x.float(), *weights, gate_fp8=quantize_weight(weights[0]), tile=32,
                                                 compression=4)
            assert_rows_close(mlp(x), expected, 3e-3)
            assert all(torch.equal(a, b) for a, b in zip(mlp.gate_e4m3(), quantize_weight(weights[0])))
            mlp.gate_proj.weight.mul_(-1.5)
        mlp.use_fp8_gate(False)
        assert mlp.gate_e4m3() is None
        assert_rows_close(mlp(x), twell.gated_mlp_reference(x.float(), *weights), 3e-3)


@pytest.mark.gpu
def test_gpu_the_modeling_layers_copy_is_made_outside_cuda_graph_captures():
    """use_fp8_gate() on a GPU makes the layer's e4m3 copy at once; a captured call finds it made; a copy gone stale
    (the weight changed) is not remade inside a capture, whose memory pool would hold it (that call reads the gate
    itself), but by the next eager call."""
    modeling = load_benchmark("inference_robustness.py").runtime()
    original = torch.nn.Module()
    for name, shape in (("gate_proj", (5632, 2048)), ("up_proj", (5632, 2048)), ("down_proj", (2048, 5632))):
        original.add_module(name, torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16, device="cuda"))
    mlp = modeling.TwellGatedMLP(original, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                                 modeling.LayerPlan("sparse", 128, 8, ((1, None),)))
    mlp.use_fp8_gate()
    made = mlp._gate_e4m3.held
    assert made is not None and made[0][0][0] == mlp.gate_proj.weight.data_ptr()
    x = torch.randn(1, 512, 2048, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(0.5)  # stale
        graph = torch.cuda.CUDAGraph()
        mlp(x)  # eager: remade
        remade = mlp._gate_e4m3.held
        assert remade is not made
        mlp.gate_proj.weight.mul_(2.0)  # stale again, then a capture (its plain launches compiled before it)
        modeling.gated_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, tile=128, compression=8)
        with torch.cuda.graph(graph):
            mlp(x)
        assert mlp._gate_e4m3.held is remade  # not remade inside the capture


# GPU: bf16 at real sizes

def real_block(m, k=29, d=2048, i=5632):
    x, gate, up, down = block(m, d, i, k=k, dtype=torch.bfloat16)
    return x, gate, up, twell.prepare_down(down), quantize_weight(gate)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 4096, 16384])
def test_gpu_fp8_gate_real_shapes(m):
    """The 1.5B shape, bf16. Batched: every row within bf16 rounding and the sign of near-zero units (the kernel
    sums g in another order than the reference) of the fp8 gate's reference, the whole block within 1.5e-2 of
    it and several times closer to it than to the plain block. Decode sizes: the plain kernels' output, bit
    for bit (they read the gate itself)."""
    torch.manual_seed(m)
    x, gate, up, down, gate_fp8 = real_block(m)
    out = twell.gated_mlp(x, gate, up, down, gate_fp8=gate_fp8)
    if launch_path(m, 2048, 5632).name != "batched":
        assert torch.equal(out, twell.gated_mlp(x, gate, up, down))
        return
    rows = slice(0, 4096)
    expected = fp8_expected(x[rows], gate, up, down, gate_fp8, 128, 8, "batched")
    assert_rows_close(out[rows], expected, 5e-2)
    plain = twell.gated_mlp_reference(x[rows].float(), gate, up, down).float()
    error = ((out[rows].float() - expected).norm() / expected.norm()).item()
    assert error < 1.5e-2 and error < ((out[rows].float() - plain).norm() / plain.norm()).item() / 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or gh.gluon is None, reason="needs an sm_90 GPU and Gluon")
def test_gpu_hopper_gate_kernel_with_the_fp8_gate_packs_like_the_triton_kernel(monkeypatch):
    """The Gluon kernel (fp8 wgmma) and the Triton kernel (fp8 tl.dot) pack the same units, their values
    equal up to the order of fp32 sums."""
    from twell.batched import gate_config, gate_launch
    from twell.format import empty_twell
    torch.manual_seed(0)
    x, gate, up, down, (weight, scale) = real_block(8192)
    xq, xs = quantize_rows(x)
    packed = []
    for hopper in (True, False):
        if not hopper:
            monkeypatch.setattr(sys.modules["twell.batched"], "hopper_gate_launch", lambda *args: None)
        launch = gate_launch(x, weight, None, 128, slots(128, 8), x.dtype, gate_config(8192, 128, 2, decode=False),
                             fp8=True)
        assert (launch.kernel is gh.gate_pack_kernel) == hopper
        tw = empty_twell(8192, 5632, 128, 8, x.dtype, x.device)
        tw.values.fill_(float("nan"))
        launch(x, weight, weight, weight, *tw[:3], tw.values, xq, xs, scale)
        packed.append(tw)
    a, b = packed
    assert torch.equal(a.counts, b.counts)
    valid = torch.arange(a.values.shape[2], device=DEV) < a.counts.clamp(max=a.values.shape[2])[..., None]
    assert torch.equal(a.indices[valid], b.indices[valid])
    assert torch.allclose(a.values[valid].float(), b.values[valid].float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
def test_gpu_fp8_gate_under_cuda_graphs_and_compile():
    """A batched call with the fp8 gate (x's quantization, the gate and out kernels) captured as a CUDA graph
    and traced by torch.compile (the custom op): both give the eager output."""
    torch.manual_seed(0)
    x, gate, up, down, gate_fp8 = real_block(512)
    eager = twell.gated_mlp(x, gate, up, down, gate_fp8=gate_fp8)
    graph = torch.cuda.CUDAGraph()
    static = x.clone()
    twell.gated_mlp(static, gate, up, down, gate_fp8=gate_fp8)  # compiled before the capture
    with torch.cuda.graph(graph):
        captured = twell.gated_mlp(static, gate, up, down, gate_fp8=gate_fp8)
    graph.replay()
    assert torch.equal(captured, eager)
    compiled = torch.compile(lambda x: twell.gated_mlp(x, gate, up, down, gate_fp8=gate_fp8), fullgraph=True)
    assert torch.equal(compiled(x), eager)
    assert math.isfinite(eager.float().norm().item())
