"""Synthetic MLP layers for the inference benchmarks (bench_inference.py, inference_robustness.py), by the method
of docs/performance.md: x ~ N(0, 1) with x[:, 0] = 1 (bias channel), gate ~ N(0, 1/D) with
gate[:, 0] = -Phi^-1(1 - k/I), so each unit fires with probability k/I; the dense bf16 block they are timed
against, the fp32 reference they are checked against, and the timing helpers they share (launch_rules: the
kernels' launch rules replaced for a measurement)."""
import math
import sys
from contextlib import contextmanager
from statistics import NormalDist

import torch
from triton.testing import do_bench_cudagraph

import twell
from twell.gated_mlp import LAUNCH_CACHE
from twell.fp8_gate import quantize_up_down, quantize_weight
from twell.paths import launch_path

LAYERS = 8  # layer copies for graph-replay timing
HEAVY_K, HEAVY_TILE = 29, 128  # --host-time, --decode-*: active units of the ordinary rows, tile
HEAVY_FIRST = 2000  # --host-time, --decode-*: active units of a sequence's first token


def make_layer(d, i, k, skew=0.0):
    gate = torch.randn(i, d, device="cuda") / math.sqrt(d)
    bias = -NormalDist().inv_cdf(1 - k / i) if k < i else 10.0  # k = I: every unit active
    gate[:, 0] = bias + skew * torch.randn(i, device="cuda")
    up = torch.randn(i, d, device="cuda") / math.sqrt(d)
    down = torch.randn(d, i, device="cuda") / math.sqrt(k)
    gate, up, down = gate.bfloat16(), up.bfloat16(), down.bfloat16()
    return dict(gate=gate, up=up, down=down, down_p=twell.prepare_down(down),
                gate_up=torch.cat([gate, up]).contiguous())


def add_fp8_gate(layers):
    """Each layer's "gate_fp8": its gate's e4m3 copy (twell.fp8_gate), made once, where a row times the fp8 gate."""
    for w in layers:
        if "gate_fp8" not in w:
            w["gate_fp8"] = quantize_weight(w["gate"])


def add_fp8_up_down(layers):
    """Each layer's "up_down_fp8": its up and down rows' e4m3 copies (twell.fp8_gate), made once, where a row
    times them."""
    for w in layers:
        if "up_down_fp8" not in w:
            w["up_down_fp8"] = quantize_up_down(w["up"], w["down"])


def make_x(m, d):
    x = torch.randn(m, d, device="cuda")
    x[:, 0] = 1.0
    return x.bfloat16()


def dense(x, w):
    i = w["gate"].shape[0]
    gu = x @ w["gate_up"].t()
    return (torch.relu(gu[:, :i]) * gu[:, i:]) @ w["down"].t()


def sparse(x, w, tile, compression, precision="default", fp8=False, fp8_up_down=False):
    """The block through twell.gated_mlp; with fp8, its gate pass in fp8 (the layer's "gate_fp8" copy); with
    fp8_up_down, its out pass on e4m3 up and down rows (the layer's "up_down_fp8")."""
    return twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=tile, compression=compression,
                           precision=precision, gate_fp8=w["gate_fp8"] if fp8 else None,
                           up_down_fp8=w["up_down_fp8"] if fp8_up_down else None)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def reference(x, w):
    return twell.gated_mlp_reference(x.float(), w["gate"], w["up"], w["down"]).float()


def per_layer_us(fn, layers):
    """Microseconds of fn(layer) per layer, over CUDA-graph replays of the layer copies."""
    return do_bench_cudagraph(lambda: [fn(lw) for lw in layers], rep=50, return_mode="median") / LAYERS * 1e3


def print_row(row):
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def make_heavy(x, rows, units, i, k=HEAVY_K):
    """Sets the bias channel of x's `rows` so that each has about `units` active units (of i) under a
    make_layer(.., i, k) gate: a unit fires where z > bias * x0 (z about N(0, 1))."""
    x[rows, 0] = NormalDist().inv_cdf(1 - units / i) / NormalDist().inv_cdf(1 - k / i)


def plan_launches(x, layers, tile=128, compression=8, fp8=False, fp8_up_down=False):
    """The gate launch (with fp8: x's quantization, then the fp8 gate's launch) and the out launch of
    twell.gated_mlp's plan for x, each a function of a layer copy,
    launches and buffers made once (built at each call, the Hopper gate launch's host time would count in
    do_bench's times at small token counts). The out launches start with the list pre-pass, which compacts
    the TwELL in place: out calls repeated without a gate call between them do the same work on reshuffled
    lists (fine for timing; their outputs mean nothing)."""
    path = launch_path(x.shape[0], x.shape[1], layers[0]["gate"].shape[0])
    plan = path.launches(x, layers[0]["gate"], layers[0]["up"], tile, compression, "default", None,
                         layers[0]["gate_fp8"] if fp8 else None, layers[0]["up_down_fp8"] if fp8_up_down else None)
    bufs = {}
    for lw in layers:
        tw = (torch.empty(plan.twell_shape, dtype=plan.vals_dtype, device=x.device),
              torch.empty(plan.twell_shape, dtype=torch.int32, device=x.device),
              torch.empty(plan.twell_shape[:2], dtype=torch.int32, device=x.device))
        partials = tw[0] if plan.partials_shape is None else torch.empty(plan.partials_shape, device=x.device)
        bufs[id(lw)] = tw, partials, torch.empty_like(x)

    def gate(lw):
        tw, partials, _ = bufs[id(lw)]
        weight, quantized = plan.gate_inputs(x, lw["gate"], lw["gate_fp8"] if fp8 else None)
        plan.gate(x, weight, lw["up"], lw["down_p"].t(), *tw, partials, *quantized)

    def out(lw):
        tw, partials, o = bufs[id(lw)]
        plan.out(x, *tw, partials, lw["gate"], lw["up"], lw["down_p"].t(), o, tw[2],
                 lw["up_down_fp8"] if fp8_up_down else None)

    for lw in layers:
        gate(lw)
    torch.cuda.synchronize()
    return gate, out


@contextmanager
def launch_rules(**rules):
    """The kernel launch paths' module-level launch rules (gate_config, out_config, decode_rows, HELD_ROWS, ...)
    replaced inside the block, in every launch-path module that holds them, the cached launches dropped on the
    way in and out."""
    modules = [sys.modules[f"twell.{name}"] for name in ("paths", "batched", "decode", "heavy")]
    saved = [(module, name, getattr(module, name)) for module in modules for name in rules if hasattr(module, name)]
    assert {name for _, name, _ in saved} == set(rules), "no launch path holds these rules"
    for module, name, _ in saved:
        setattr(module, name, rules[name])
    LAUNCH_CACHE.clear()
    try:
        yield
    finally:
        for module, name, rule in saved:
            setattr(module, name, rule)
        LAUNCH_CACHE.clear()
