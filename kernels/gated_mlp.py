"""The TwELL op for a ReLU-gated MLP, inference only: gated_mlp(x, gate, up, down) = down(relu(gate(x)) * up(x)),
no host synchronization. A call takes one launch path by its token count (paths.PATHS, each path's contract:
one gated token takes the tile-out path, up to format.decode_rows tokens decode, more batched, its heavy rows
through heavy.py). Calls of the same shapes, strides, dtypes and alignment reuse their launches
(LAUNCH_CACHE). CPU tensors without the Triton interpreter take reference.forward_reference. The down weight
is read transposed: pass `prepare_down(down)` (made once at load time) to avoid a per-call transpose copy. A launch
configuration beyond the GPU (Triton's OutOfResources: shared memory on a GPU with less than the H100's) makes
calls of that shape run the dense block, with a warning, instead of failing. With `gate_fp8` (fp8_gate.py) the
batched path's gate kernel reads the gate's e4m3 copy and x quantized a token at a time (paths.LaunchPath.fp8_gate:
the paths where that wins); with `up_down_fp8` its out kernel walks e4m3 up and down rows
(paths.LaunchPath.fp8_up_down). With a `residual`, the call returns residual + the block, as a decoder layer adds
them: the one-token path adds it in its last launch, the others after theirs."""
import warnings
from collections import OrderedDict
from typing import Optional

import torch

from .format import on_device, slots, use_triton
from .fp8_gate import E4M3, UpDownE4m3, check_device
from .launch import custom_op
from .paths import launch_path, reads_fp8_gate, reads_fp8_up_down
from .reference import forward_reference

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # CPU-only machines run the reference path
    OutOfResources = None

PRECISIONS = ("default", "highest")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the kernels compute in (x and weights alike)


def prepare_down(down_weight: torch.Tensor) -> torch.Tensor:
    """Load-time layout for the down weight: same [D, I] shape, stored transposed (its .t() is contiguous)."""
    return down_weight.t().contiguous().t()


LAUNCH_CACHE_SIZE = 256  # launch sets kept (layers of one shape share them; a new prompt length adds one)
LAUNCH_CACHE = OrderedDict()  # recent launch sets by _launch_key, least recently used first


def _launch_key(x2, gate, up, down_t, tile, compression, precision, overflow, gate_fp8, up_down_fp8, residual):
    """Shapes, strides, dtypes, devices and each pointer's alignment: what the launches depend on (Triton
    specializes a kernel on every pointer argument's 16-byte alignment)."""
    tensors = [t for t in (x2, gate, down_t, up, overflow, *(gate_fp8 or ()), *(up_down_fp8 or ()), residual)
               if t is not None]
    return (tile, compression, precision, overflow is not None, gate_fp8 is not None, up_down_fp8 is not None,
            residual is not None, *((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors))


def check_args(x, gate, up, down, tile, compression, precision, overflow, gate_fp8=None, up_down_fp8=None,
               residual=None):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    fp8 = (*(gate_fp8 or ()), *(up_down_fp8 or ()))
    devices = {str(t.device) for t in (x, gate, up, down, overflow, *fp8) if t is not None}
    if len(devices) > 1:
        given = ("x, the weights" + (", gate_fp8" if gate_fp8 is not None else "")
                 + (", up_down_fp8" if up_down_fp8 is not None else "") + " and overflow")
        raise ValueError(f"{given} must be on one device, got {sorted(devices)}")
    width, d = gate.shape
    if x.shape[-1] != d or down.shape != (d, width) or up.shape != gate.shape:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, gate and up [I, D] = {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}, down {tuple(down.shape)} (expected [D, I])")
    if width > 65536:
        raise ValueError(f"I = {width} > 65536 is not supported")
    if overflow is not None and (overflow.numel() not in (1, 4) or overflow.dtype not in (torch.int32, torch.int64)):
        raise ValueError("overflow must be a one- or four-element int32 or int64 tensor")
    if overflow is not None and not overflow.is_contiguous():  # the kernels add to its elements by offset
        raise ValueError("overflow must be contiguous")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"residual must have x's shape, dtype and device ({tuple(x.shape)} {x.dtype} {x.device}), "
                         f"got {tuple(residual.shape)} {residual.dtype} {residual.device}")
    slots(tile, compression)
    if gate_fp8 is not None:
        check_gate_fp8(x, gate, precision, gate_fp8)
    if up_down_fp8 is not None:
        check_up_down_fp8(x, gate, precision, up_down_fp8)


def _check_e4m3_copy(name, of, weight, scale, shape, made_by, contiguous=False):
    if weight.dtype != E4M3 or weight.shape != shape or (contiguous and not weight.is_contiguous()):
        raise ValueError(f"{name} must be {of} {E4M3} copy, {'contiguous, ' if contiguous else ''}shape "
                         f"{tuple(shape)} ({made_by}), got {weight.dtype} {tuple(weight.shape)}")
    if scale.dtype != torch.float32 or scale.shape != shape[:1] or not scale.is_contiguous():
        raise ValueError(f"{name}'s scale must be contiguous float32 [{shape[0]}], a scale a unit, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


def _check_fp8_input(x, precision, what):
    if x.dtype not in (torch.float16, torch.bfloat16) or precision != "default":
        raise ValueError(f"{what} takes 16-bit x at precision 'default', got {x.dtype} at {precision!r}")
    check_device(x.device, what)


def check_gate_fp8(x, gate, precision, gate_fp8):
    _check_e4m3_copy("gate_fp8's weight", "the gate's", *gate_fp8, gate.shape, "fp8_gate.quantize_weight")
    _check_fp8_input(x, precision, "the fp8 gate")


def check_up_down_fp8(x, gate, precision, up_down_fp8):
    if not isinstance(up_down_fp8, UpDownE4m3):
        raise ValueError(f"up_down_fp8 must be fp8_gate.quantize_up_down(up, down)'s UpDownE4m3, got "
                         f"{type(up_down_fp8).__name__}")
    made_by = "fp8_gate.quantize_up_down"
    _check_e4m3_copy("up_down_fp8.up", "up's", up_down_fp8.up, up_down_fp8.up_scale, gate.shape, made_by, True)
    _check_e4m3_copy("up_down_fp8.down_t", "down's transposed", up_down_fp8.down_t, up_down_fp8.down_scale,
                     gate.shape, made_by, True)
    _check_fp8_input(x, precision, "reading e4m3 up and down rows")


def check_kernel_dtypes(x, gate, up, down):
    dtypes = {t.dtype for t in (x, gate, up, down)}
    if len(dtypes) > 1 or not dtypes <= set(KERNEL_DTYPES):
        raise ValueError(f"the kernels take x and the weights in one of {[str(t) for t in KERNEL_DTYPES]}, got x "
                         f"{x.dtype}, gate {gate.dtype}, up {up.dtype}, down {down.dtype}")


def forward(x, gate, up, down, tile, compression, precision, overflow=None, gate_fp8=None, up_down_fp8=None,
            residual=None):
    """The block's body (gated_mlp, its custom ops, the modeling file's layers), plus the residual if given.
    Calls look their checked arguments and launches up by _launch_key instead of rebuilding them: building
    them and a first launch through Triton's JIT cost more host time than a whole block takes on the GPU at
    small token counts."""
    tokens = x.numel() // max(x.shape[-1], 1)
    if gate_fp8 is not None and not reads_fp8_gate(tokens, x.shape[-1], gate.shape[0]):
        check_gate_fp8(x, gate, precision, gate_fp8)
        gate_fp8 = None
    if up_down_fp8 is not None and not reads_fp8_up_down(tokens, x.shape[-1], gate.shape[0]):
        check_up_down_fp8(x, gate, precision, up_down_fp8)
        up_down_fp8 = None
    if not use_triton(x):
        check_args(x, gate, up, down, tile, compression, precision, overflow, gate_fp8, up_down_fp8, residual)
        return _added(residual, forward_reference(x, gate, up, down, tile, compression, overflow, gate_fp8,
                                                  up_down_fp8))
    with on_device(x):
        return _forward_triton(x, gate, up, down, tile, compression, precision, overflow, gate_fp8, up_down_fp8,
                               residual)


def _added(residual, out):
    return out if residual is None else residual + out


def _forward_triton(x, gate, up, down, tile, compression, precision, overflow, gate_fp8, up_down_fp8, residual):
    if x.shape[-1] != gate.shape[1] or (residual is not None and residual.shape != x.shape):
        # before the reshapes, so that it fails as a ValueError
        check_args(x, gate, up, down, tile, compression, precision, overflow, gate_fp8, up_down_fp8, residual)
    x2 = x.reshape(-1, x.shape[-1])
    down_t = down.t().contiguous()  # no copy when the weight came from prepare_down
    up = up.contiguous()
    gate = gate.contiguous()  # the overflow fallback reads contiguous rows; one copy serves both kernels
    residual2 = residual.reshape(x2.shape).contiguous() if residual is not None else None  # read as [M, D] rows
    key = _launch_key(x2, gate, up, down_t, tile, compression, precision, overflow, gate_fp8, up_down_fp8, residual2)
    launches = LAUNCH_CACHE.get(key)
    if launches is None:
        check_args(x, gate, up, down, tile, compression, precision, overflow, gate_fp8, up_down_fp8, residual)
        check_kernel_dtypes(x, gate, up, down)
        if x2.shape[0] == 0:
            return x.new_empty(x.shape)
        path = launch_path(x2.shape[0], x2.shape[1], gate.shape[0])
        launches = LAUNCH_CACHE[key] = path.launches(x2, gate, up, tile, compression, precision, overflow, gate_fp8,
                                                     up_down_fp8, residual2)
        if len(LAUNCH_CACHE) > LAUNCH_CACHE_SIZE:
            LAUNCH_CACHE.popitem(last=False)
    else:
        LAUNCH_CACHE.move_to_end(key)
    if launches.unsupported is None:
        try:
            out = launches(x, x2, gate, up, down_t, overflow, gate_fp8, up_down_fp8, residual2)
            return out if launches.adds_residual else _added(residual, out)
        except OutOfResources as error:  # a launch configuration beyond this GPU (shared memory, threads)
            launches.unsupported = str(error)
            name = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
            warnings.warn(f"twell: {error} ({name}): calls of {x2.shape[0]} tokens at D {x2.shape[1]} / I "
                          f"{gate.shape[0]} run the dense block on this device", stacklevel=3)
    return _added(residual, ((torch.relu(x2 @ gate.t()) * (x2 @ up.t())) @ down_t).view(x.shape))


def _fp8_copies(gate_fp8_weight, gate_fp8_scale, up_fp8, down_t_fp8, up_fp8_scale, down_fp8_scale):
    """The custom ops' flat optional tensors as forward's (gate_fp8, up_down_fp8)."""
    gate_fp8 = None if gate_fp8_weight is None else (gate_fp8_weight, gate_fp8_scale)
    up_down = None if up_fp8 is None else UpDownE4m3(up_fp8, down_t_fp8, up_fp8_scale, down_fp8_scale)
    return gate_fp8, up_down


def _op_body(x, gate, up, down, tile, compression, precision, gate_fp8_weight=None, gate_fp8_scale=None,
             up_fp8=None, down_t_fp8=None, up_fp8_scale=None, down_fp8_scale=None):
    return forward(x, gate, up, down, tile, compression, precision, None,
                   *_fp8_copies(gate_fp8_weight, gate_fp8_scale, up_fp8, down_t_fp8, up_fp8_scale, down_fp8_scale))


def _op_body_overflow(x, gate, up, down, tile, compression, precision, overflow, gate_fp8_weight=None,
                      gate_fp8_scale=None, up_fp8=None, down_t_fp8=None, up_fp8_scale=None, down_fp8_scale=None):
    return forward(x, gate, up, down, tile, compression, precision, overflow,
                   *_fp8_copies(gate_fp8_weight, gate_fp8_scale, up_fp8, down_t_fp8, up_fp8_scale, down_fp8_scale))


_ARGS = "Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, int tile, int compression, str precision"
# the fp8 gate's copy and scales (gate_fp8), then the e4m3 up and down rows and their scales (up_down_fp8)
_FP8 = ", ".join(f"Tensor? {name}=None" for name in ("gate_fp8_weight", "gate_fp8_scale", "up_fp8", "down_t_fp8",
                                                      "up_fp8_scale", "down_fp8_scale"))


def _fake_out(x, *args):
    return x.new_empty(x.shape)


_gated_mlp_op = custom_op("gated_mlp", _op_body, f"({_ARGS}, {_FP8}) -> Tensor", _fake_out)
_gated_mlp_overflow_op = custom_op("gated_mlp_overflow", _op_body_overflow,
                                   f"({_ARGS}, Tensor(a!) overflow, {_FP8}) -> Tensor", _fake_out, ("overflow",))


def gated_mlp(x, gate_weight, up_weight, down_weight, *, tile: int = 128, compression: int = 8,
              precision: str = "default", overflow: Optional[torch.Tensor] = None,
              gate_fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
              up_down_fp8: Optional[UpDownE4m3] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """down(relu(gate(x)) * up(x)) through TwELL. HF layouts: gate/up [I, D], down [D, I]; x [..., D].

    `overflow`, if given (int32/int64), gets the number of overflowing (row, tile) pairs added to its first
    element; a four-element one also gets, where the call takes the batched path, the active units of every
    UNIT_SAMPLE-th row that is not heavy added to the second, those rows' count to the third and the heavy
    rows' count to the fourth.

    `gate_fp8`, if given: (the gate's e4m3 copy, its fp32 scale a unit) from fp8_gate.quantize_weight. Calls
    of the batched path then compute g in fp8 (reference.gate_values); decode-size calls, where it does not
    win, read the gate itself, and so do up, down and the dense fallbacks. x must be 16-bit, precision "default".

    `up_down_fp8`, if given: fp8_gate.quantize_up_down(up, down). The batched path's out kernel then reads the
    active units' up and down rows in e4m3 (reference.gated_mlp_reference); decode-size calls, heavy rows and
    overflowing tiles read up and down themselves. x must be 16-bit, precision "default".

    `residual`, if given (x's shape, dtype and device): the call returns residual + the block's output (rounded to
    x's dtype first), the add of a pre-norm decoder layer; a one-token call adds it in its tile sum.
    """
    args = (x, gate_weight, up_weight, down_weight, tile, compression, precision)
    # eager calls skip the custom ops, whose dispatch costs about as much host time as the decode kernels
    # take on the GPU; what traces the call (compile, export, dispatch modes, tensor subclasses) needs them
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or type(x) is not torch.Tensor:
        fp8 = (*(gate_fp8 if gate_fp8 is not None else (None, None)),
               *(up_down_fp8 if up_down_fp8 is not None else (None,) * 4))
        out = _gated_mlp_op(*args, *fp8) if overflow is None else _gated_mlp_overflow_op(*args, overflow, *fp8)
        return _added(residual, out)
    return forward(*args, overflow, gate_fp8, up_down_fp8, residual)
