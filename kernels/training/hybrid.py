"""Hybrid TwELL training: a ReLU-gated MLP block, forward and backward (autograd), on the per-row sparse pattern
of its gate: rows with at most max_nnz active units go through ELL slots and row-gathering kernels (ell.py),
the others through a dense backup over a device-side row list (backup.py), with no host synchronization; also
the block's sparsity penalty (L1 or the log penalty: penalty.py) and activity statistics, and the choice of hot
units run as dense columns. Training only: not copied into checkpoints. Reference:
reference.hybrid_gated_mlp_reference. A launch configuration beyond the GPU (Triton's OutOfResources) makes that
pass (forward or backward) of blocks of that shape and dtype run the reference's math, with a warning.
"""
import warnings

import torch

from ..format import on_device, use_triton
from .backup import ROWS_BACKWARD, ROWS_FORWARD, backup_list, hot_grads, rows_mm, rows_units, rows_wgrad
from .blocks import blocks
from .ell import A_AND_B, A_TIMES_B, DH_GATED, build_csc, fused_dh, pack_ell, sddmm, spmm, transpose, wgrad
from .penalty import penalty
from .reference import HybridStats, hybrid_gated_mlp_reference

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # CPU-only installs run the reference
    OutOfResources = None


def _compute_dtype(x):
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


class _HybridGatedMLP(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, gate_w, up_w, down_w, max_nnz, hot, eps):
        dt = _compute_dtype(x)
        ctx.dtypes = (x.dtype, gate_w.dtype, up_w.dtype, down_w.dtype)
        ctx.x_shape = x.shape
        D = x.shape[-1]
        E = int(max_nnz)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, D).to(dt).contiguous()
            gate, up, down = (w.to(dt).contiguous() for w in (gate_w, up_w, down_w))
            M, I = x2.shape[0], gate.shape[0]
            pre = x2 @ gate.t()  # [M, I] dense, transient
            cold = None
            if hot is not None:  # dense columns: kept out of the ELL and the backup
                g_hot = pre[:, hot]
                cold = torch.ones(I, dtype=torch.int8, device=x.device).index_fill_(0, hot, 0)
            idx, g, nnz, _, fired = pack_ell(pre, E, cold)
            u = torch.empty((M, E), dtype=torch.float32, device=x.device)
            downT = transpose(down, dt)  # [I, D]: rows gathered per active unit
            *backup, n_backup = backup_list(nnz, E)
            l1_backup = rows_units(ROWS_FORWARD, backup, x2, up, pre=pre, cold=cold, eps=eps)  # pre's backup rows: h
            rowsum = sddmm(x2, up, idx, nnz, g, u, backward=False, eps=eps)
            out = spmm(idx, nnz, g, downT, u, dtype=dt)
            rows_mm(backup, pre, downT, out)
            del pre
            csc = build_csc(idx, I, blocks(x.device)["SEG"]) if any(ctx.needs_input_grad[1:4]) else ()
            l1_sum, n_active, fired = rowsum.sum() + l1_backup, nnz.sum(), fired.long()
            if hot is not None:
                u_hot = x2 @ up[hot].t()
                h_hot = torch.relu(g_hot) * u_hot
                out.addmm_(h_hot, downT[hot])
                l1_sum = l1_sum + penalty(h_hot.float().abs(), eps).sum()
                on = g_hot > 0
                n_active = n_active + on.sum()
                fired = fired.index_add(0, hot, on.sum(0))
                hot_state = (hot, cold, g_hot, u_hot)
            else:
                hot_state = ()
            l1 = l1_sum / M
            active = n_active.float() / M
        ctx.save_for_backward(x2, gate, up, down, idx, nnz, g, u, *backup, *hot_state, *csc)
        ctx.n_hot = len(hot_state)
        ctx.E, ctx.eps = E, eps
        ctx.mark_non_differentiable(active, fired, n_backup)
        return out.reshape(*ctx.x_shape[:-1], down.shape[0]), l1, active, fired, n_backup

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout, dl1, *_):
        saved = ctx.saved_tensors  # unpacked once: activation checkpointing allows no second time
        x2, gate, up, down = saved[:4]
        key = _block_key(x2, gate)
        if key not in _BEYOND_THE_DEVICE["backward"]:
            try:
                return _HybridGatedMLP.sparse_backward(ctx, saved, dout, dl1)
            except OutOfResources as error:
                _beyond_the_device(error, key, "backward", stacklevel=1)
        return (*_reference_grads(ctx, x2, gate, up, down, dout, dl1), None, None, None)

    @staticmethod
    def sparse_backward(ctx, saved, dout, dl1):
        x2, gate, up, down, idx, nnz, g, u, *saved = saved
        backup, hot_state, csc = saved[:2], saved[2:2 + ctx.n_hot], saved[2 + ctx.n_hot:]
        E, eps = ctx.E, ctx.eps
        M, D = x2.shape
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        with torch.autocast(x2.device.type, enabled=False):
            dout2, c, downT, csc = _backward_inputs(x2, down, idx, gate.shape[0], csc, dout, dl1)
            ddownT = None
            if fused_dh(D, x2.device):  # dh rides in the d_down kernel (one gather of dout rows)
                dgp = torch.empty((M, E), dtype=torch.float32, device=x2.device)
                du = torch.empty((M, E), dtype=torch.float32, device=x2.device)
                ddownT, _ = wgrad(csc, E, g, u, dout2, mode=DH_GATED, w=downT, c=c, o1=dgp, o2=du, eps=eps)
            else:
                dgp, du = sddmm(dout2, downT, idx, nnz, g, u, backward=True, c=c, eps=eps)
            # the backup rows' dense [rows, I] gradients (other rows of these buffers are never written)
            hot, cold, g_hot, u_hot = hot_state or (None,) * 4
            dgpb, dub, hb = rows_units(ROWS_BACKWARD, backup, x2, gate, w2=up, dout=dout2, down=down, c=c,
                                       cold=cold, eps=eps)
            if hot_state:  # the hot columns' gradients, dense for every row
                dgp_hot, du_hot, h_hot = hot_grads(g_hot, u_hot, dout2 @ down[:, hot], c, eps)
            dx = dgate = dup = ddown = None
            if need_x:
                dx = spmm(idx, nnz, dgp, gate, du, up, dtype=x2.dtype)
                rows_mm(backup, dgpb, gate, dx, dub, up)
                if hot_state:
                    dx.addmm_(dgp_hot, gate[hot]).addmm_(du_hot, up[hot])
                dx = dx.reshape(ctx.x_shape).to(ctx.dtypes[0])
            if need_gate or need_up:
                dgate, dup = wgrad(csc, E, dgp, du, x2, mode=A_AND_B)
                rows_wgrad(backup, dgpb, x2, dgate)
                rows_wgrad(backup, dub, x2, dup)
                if hot_state:
                    dgate.index_add_(0, hot, (dgp_hot.t() @ x2).float())
                    dup.index_add_(0, hot, (du_hot.t() @ x2).float())
                dgate, dup = dgate.to(ctx.dtypes[1]), dup.to(ctx.dtypes[2])
            if need_down:
                if ddownT is None:
                    ddownT, _ = wgrad(csc, E, g, u, dout2, mode=A_TIMES_B)
                rows_wgrad(backup, hb, dout2, ddownT)
                if hot_state:
                    ddownT.index_add_(0, hot, (h_hot.t() @ dout2).float())
                ddown = transpose(ddownT, ctx.dtypes[3])
        return dx, (dgate if need_gate else None), (dup if need_up else None), ddown, None, None, None


def _reference_grads(ctx, x2, gate, up, down, dout, dl1):
    """The gradients of x and the weights (None where not needed) through the reference's dense math."""
    needed = ctx.needs_input_grad[:4]
    with torch.enable_grad(), torch.autocast(x2.device.type, enabled=False):
        leaves = [t.detach().requires_grad_(need) for t, need in zip((x2, gate, up, down), needed)]
        out, stats = hybrid_gated_mlp_reference(*leaves, l1_eps=ctx.eps)
        grads = iter(torch.autograd.grad((out, stats.l1), [t for t in leaves if t.requires_grad],
                                         (dout.reshape(out.shape).to(out.dtype), dl1.to(stats.l1.dtype))))
    return tuple(next(grads).reshape(ctx.x_shape if i == 0 else w.shape).to(ctx.dtypes[i]) if need else None
                 for i, (need, w) in enumerate(zip(needed, (x2, gate, up, down))))


# _block_key of the blocks whose forward or backward launches the GPU cannot run (OutOfResources): that pass
# runs the reference's math. Kept apart: a failed backward leaves the forward on the kernels, so that
# activation checkpointing recomputes a forward that saves what the original one saved.
_BEYOND_THE_DEVICE = {"forward": set(), "backward": set()}


def _block_key(x, gate_weight):
    """What the launches depend on: device, compute dtype, D and I."""
    return x.device, _compute_dtype(x), x.shape[-1], gate_weight.shape[0]


def _beyond_the_device(error, key, stage: str, stacklevel: int):
    _BEYOND_THE_DEVICE[stage].add(key)
    device, dtype, d, width = key
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    warnings.warn(f"twell: {error} ({name}): the {stage} of hybrid training blocks of D {d} / I {width} in {dtype} "
                  "runs the dense reference on this device", stacklevel=stacklevel + 1)


def _backward_inputs(x2, down, idx, width, csc, dout, dl1):
    """What both backwards start from: dout as [M, D] in the compute dtype, the penalty's gradient scale
    (dl1 / M), the transposed down weight, and the pattern's CSC (rebuilt when the forward did not save it)."""
    m, d = x2.shape
    dout2 = dout.reshape(-1, d).to(x2.dtype).contiguous()
    c = (dl1.float() / m).reshape(1)
    return dout2, c, transpose(down, x2.dtype), csc or build_csc(idx, width, blocks(x2.device)["SEG"])


def hybrid_gated_mlp(x, gate_weight, up_weight, down_weight, *, max_nnz=128, hot_units=None, l1_eps=0.0):
    """down(relu(gate(x)) * up(x)) on the hybrid sparse format; HF layouts gate/up [I, D], down [D, I].
    Returns (out [..., D], HybridStats). Rows with more than max_nnz active units run dense.
    `hot_units` (distinct int64 unit indices, e.g. from `hot_units(stats.fired, tokens)` of an earlier
    step) run as dense columns for every row, outside the ELL and the row budget max_nnz.
    `l1_eps`: the stats' penalty, 0 for L1, > 0 for the log penalty with that eps (penalty.py)."""
    if hot_units is not None:
        _check_hot_units(hot_units, x, gate_weight.shape[0])
    if isinstance(l1_eps, bool) or not isinstance(l1_eps, (int, float)) or not 0 <= l1_eps < float("inf"):
        raise ValueError(f"l1_eps must be a finite number >= 0 (0: L1), got {l1_eps!r}")
    if use_triton(x) and (key := _block_key(x, gate_weight)) not in _BEYOND_THE_DEVICE["forward"]:
        try:
            with on_device(x):  # the backward runs on the autograd engine's thread of x's device
                out, l1, active, fired, backup = _HybridGatedMLP.apply(x, gate_weight, up_weight, down_weight,
                                                                       max_nnz, hot_units, float(l1_eps))
            return out, HybridStats(l1, active, fired, backup)
        except OutOfResources as error:
            _beyond_the_device(error, key, "forward", stacklevel=2)
    return hybrid_gated_mlp_reference(x, gate_weight, up_weight, down_weight, max_nnz=max_nnz, hot_units=hot_units,
                                      l1_eps=l1_eps)


def _check_hot_units(hot, x, width):
    if not isinstance(hot, torch.Tensor) or hot.dim() != 1 or hot.dtype != torch.int64 or hot.device != x.device:
        raise ValueError(
            f"hot_units must be a 1-D int64 tensor on {x.device}, got "
            f"{type(hot).__name__ if not isinstance(hot, torch.Tensor) else (hot.dtype, tuple(hot.shape), hot.device)}")
    if hot.numel():  # a repeated unit would count twice: checked on the device, without a host sync
        ok = (hot[0] >= 0) & (hot[-1] < width) & (hot[1:] > hot[:-1]).all()
        torch._assert_async(ok, "hot_units must be sorted, distinct unit indices in [0, I)")


# A unit that fires in a share r of M tokens costs, in the sparse passes, about r M x 6 gathers of 2 D
# bytes (6 TB/s from L2); as a dense column, 8 matmul columns of 2 M D FLOPs (about 600 TFLOP/s): equal
# at r = (16 / 600e12) / (12 / 6e12), about 1.3% on an H100, whatever D and M.
HOT_RATE = 0.013


def hot_units(fired: torch.Tensor, tokens, rate: float = HOT_RATE):
    """The busiest units among those that fired in more than `rate` of `tokens` tokens (int64 indices,
    sorted), as many as the largest multiple of 64 (of 8 below 64) that fits, so that the dense columns'
    matmuls keep aligned shapes (cuBLAS runs far below its FLOP rate at unaligned widths); or None."""
    n = int((fired > rate * tokens).sum())
    n = n - n % (64 if n >= 64 else 8)
    return torch.topk(fired, n).indices.sort().values if n else None
