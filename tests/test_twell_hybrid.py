"""Hybrid TwELL training kernels against PyTorch autograd of the dense block (float64), with the sparsity
penalty (L1, or the log penalty: LOG_EPS) in the loss. CPU: fp32 through the Triton interpreter, small shapes, not
multiples of the tiles (the interpreter tiles are 16 wide in D, 4 slots, 32 units). GPU (-m gpu): bf16 under
autocast."""
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from twell.training import hybrid as H
from twell.training.reference import hybrid_gated_mlp_reference

from helpers import poison_allocations

L1_COEFF = 0.37  # large, so that a wrong penalty gradient shows in every weight's gradient
LOG_EPS = 0.3  # the log penalty's eps, about the median |h| of the sparse rows: far from L1 for many units


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def problem(M, D, I, k, *, special_rows=True, device="cpu", seed=0):
    """Bias-channel recipe (docs/performance.md): about k active units a row; row 0 (if M > 2) is empty and
    row 1 fully dense (forces the backup); unit 2 fires in nearly every row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=gen)
    x[:, 0] = 1.0
    w = torch.randn(I, D, generator=gen) / D**0.5
    w[:, 0] = -torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - k / I))
    w[2, 0] = 3.0  # a hot unit, in nearly every row: its weight gradient spans several segments
    if special_rows and M > 2:
        x[0, 0] = 50.0  # bias dominates: every pre-activation < 0
        x[1, 0] = -50.0  # every pre-activation > 0
    up = torch.randn(I, D, generator=gen) / D**0.5
    down = torch.randn(D, I, generator=gen) / k**0.5
    return [t.to(device) for t in (x, w, up, down)]


def run(fn, tensors, dout, max_nnz, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, stats = fn(*leaves, max_nnz=max_nnz, **kw)
    ((out.float() * dout).sum() + L1_COEFF * stats.l1).backward()
    return out, stats, [t.grad for t in leaves]


def check(tensors, max_nnz, tol=1e-5, **kw):
    M, D = tensors[0].shape[0], tensors[-1].shape[0]
    dout = torch.randn(M, D, generator=torch.Generator().manual_seed(1)).to(tensors[0].device)
    out, st, grads = run(H.hybrid_gated_mlp, tensors, dout, max_nnz, **kw)
    rout, rst, rgrads = run(hybrid_gated_mlp_reference, [t.double() for t in tensors], dout.double(), max_nnz, **kw)
    assert torch.isfinite(out).all()
    assert rel(out, rout) < tol
    assert rel(st.l1, rst.l1) < tol
    for g, rg in zip(grads, rgrads):
        assert g.dtype == torch.float32 and rel(g, rg) < tol
    assert st.fired.dtype == torch.int64 and torch.equal(st.fired.cpu(), rst.fired.cpu())
    assert abs(st.active.item() - rst.active.item()) < 1e-4
    assert int(st.backup_rows) == int(rst.backup_rows)
    assert not st.active.requires_grad and st.l1.requires_grad
    return st


# D = 70 > 64 takes the unfused backward SDDMM in the interpreter; the others the fused one
@pytest.mark.parametrize("eps", [0.0, LOG_EPS])
@pytest.mark.parametrize("M,D,I,k,E", [(37, 45, 70, 6, 12), (1, 33, 50, 5, 16), (64, 19, 100, 9, 11),
                                       (20, 70, 30, 5, 8)])
def test_matches_dense_autograd(M, D, I, k, E, eps):
    st = check(problem(M, D, I, k), E, l1_eps=eps)
    if M > 2:  # the sparse path and the backup both ran
        assert 1 <= int(st.backup_rows) < M


@pytest.mark.parametrize("eps", [0.0, LOG_EPS])
def test_all_rows_dense_backup(eps):
    st = check(problem(21, 24, 40, 30, special_rows=False), max_nnz=3, l1_eps=eps)
    assert int(st.backup_rows) == 21


def test_log_penalty_is_not_l1():
    """The log penalty's value and gradients (the penalty's alone: dout 0, so down gets none) differ from L1's by
    far more than the tolerance of the checks, so that a kernel computing L1 where eps asks for the log penalty
    fails them."""
    tensors = problem(37, 45, 70, 6)
    dout = torch.zeros(37, 45)
    (l1, l1_grads), (log, log_grads) = (run(hybrid_gated_mlp_reference, tensors, dout, 12, l1_eps=eps)[1:]
                                        for eps in (0.0, LOG_EPS))
    assert rel(log.l1, l1.l1) > 0.1 and all(rel(a, b) > 0.1 for a, b in zip(log_grads[:3], l1_grads[:3]))  # x, gate, up


@pytest.mark.parametrize("eps", [-0.1, float("inf"), float("nan"), torch.tensor(0.3), True])
def test_bad_eps_is_refused(eps):
    with pytest.raises(ValueError, match="l1_eps must be a finite number >= 0"):
        H.hybrid_gated_mlp(*problem(9, 20, 70, 5), max_nnz=8, l1_eps=eps)


@pytest.mark.parametrize("all_dense, eps", [(False, 0.0), (True, 0.0), (False, LOG_EPS)])
def test_hot_units_as_dense_columns(all_dense, eps):
    """Hot units (a busy one, a quiet one, one that never fires) run as dense columns: same outputs and
    gradients; they do not count towards a row's ELL budget, so fewer rows go to the backup than without them."""
    tensors = problem(45, 30, 70, 8, special_rows=not all_dense)
    if all_dense:
        tensors[0][:, 0] = -50.0  # every unit of every row active
    pre = tensors[0] @ tensors[1].t()
    fired = (pre > 0).sum(0)
    never = int((fired == 0).nonzero()[0]) if (fired == 0).any() else 0
    hot = torch.tensor(sorted({2, 9, never}))
    st = check(tensors, 10, hot_units=hot, l1_eps=eps)
    assert int(st.backup_rows) == int(((pre > 0).sum(1) - (pre[:, hot] > 0).sum(1) > 10).sum())


@pytest.mark.parametrize("hot", [torch.tensor([3, 3]), torch.tensor([5, 2]), torch.tensor([0, 70]),
                                 torch.tensor([1.0]), [2, 5], torch.tensor([[1, 2]])])
def test_bad_hot_units_are_refused(hot):
    tensors = problem(9, 20, 70, 5)
    with pytest.raises((ValueError, RuntimeError), match="hot_units must be"):
        H.hybrid_gated_mlp(*tensors, max_nnz=8, hot_units=hot)


def test_hot_units_rule():
    fired = torch.arange(200).flip(0)  # unit j fired 199 - j times
    assert H.hot_units(fired, 1000, rate=0.05).tolist() == list(range(128))  # 149 above the rate: 128 kept
    assert H.hot_units(fired, 1000, rate=0.19).tolist() == list(range(8))  # 9 above: 8 kept
    assert H.hot_units(fired, 1000, rate=0.9) is None


def test_nan_poisoned_buffers(monkeypatch):
    """Every buffer the kernels write starts as NaN (floats) or garbage (ints): all of it must be
    written or never read."""
    allocations = poison_allocations(monkeypatch, "twell.training.ell", "twell.training.backup",
                                     "twell.training.hybrid")
    check(problem(29, 35, 60, 7), max_nnz=10)
    check(problem(29, 35, 60, 7), max_nnz=10, hot_units=torch.tensor([2, 40]), l1_eps=LOG_EPS)
    assert (29, 10) in allocations  # the ELL's [M, E] buffers were poisoned


def saved_activation_bytes(fn, tensors, max_nnz):
    """Bytes saved for backward, not counting the inputs themselves (x and the weights)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    inputs = {t.data_ptr() for t in leaves}
    saved = []

    def pack(t):
        if t.data_ptr() not in inputs:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, st = fn(*leaves, max_nnz=max_nnz)
    return sum(saved), st


@pytest.mark.interpreter  # the kernels' saved state: on a GPU machine CPU tensors take the reference path
def test_saves_sparse_state_only():
    """Without backup rows, the saved activations are [M, max_nnz]-sized: under 1/4 of the dense
    block's (which saves several [M, I] tensors)."""
    tensors = problem(40, 24, 300, 4, special_rows=False)
    hybrid, st = saved_activation_bytes(H.hybrid_gated_mlp, tensors, 32)
    dense, _ = saved_activation_bytes(hybrid_gated_mlp_reference, tensors, 32)
    assert int(st.backup_rows) == 0 and dense >= 4 * 40 * 300 * 4
    assert 0 < hybrid <= dense / 4


def test_grad_accumulation_checkpoint_noncontiguous():
    x, gate, up, down = problem(26, 30, 55, 6)
    # weights as non-contiguous views (as FSDP/DDP may hand them over), x a strided slice
    gate_p = gate.t().contiguous().requires_grad_()
    up_p, down_p = up.clone().requires_grad_(), down.clone().requires_grad_()
    x_big = torch.stack([x, -x], 2).reshape(26, 60).requires_grad_()  # [:, ::2] is x
    dout = torch.randn(26, 30)

    def loss_fn(xx):
        out, st = H.hybrid_gated_mlp(xx[:, ::2], gate_p.t(), up_p, down_p, max_nnz=9)
        return (out * dout).sum() + L1_COEFF * st.l1

    loss_fn(x_big).backward()
    first = [p.grad.clone() for p in (x_big, gate_p, up_p, down_p)]
    checkpoint(loss_fn, x_big, use_reentrant=False).backward()
    for p, g in zip((x_big, gate_p, up_p, down_p), first):
        assert rel(p.grad, 2 * g) < 1e-6
    _, _, ref = run(hybrid_gated_mlp_reference, [t.double() for t in (x, gate, up, down)],
                    dout.double(), 9)
    assert rel(first[0][:, ::2], ref[0]) < 1e-5 and rel(first[1].t(), ref[1]) < 1e-5


def test_frozen_weights():
    """Only x needs a gradient (frozen weights): the backward builds the CSC it still needs."""
    tensors = problem(23, 30, 40, 6)
    dout = torch.randn(23, 30)
    grads = []
    for f, dtype in ((H.hybrid_gated_mlp, torch.float32), (hybrid_gated_mlp_reference, torch.float64)):
        x = tensors[0].detach().to(dtype).requires_grad_()
        out, st = f(x, *(w.to(dtype) for w in tensors[1:]), max_nnz=7)
        ((out * dout.to(dtype)).sum() + L1_COEFF * st.l1).backward()
        grads.append(x.grad)
    assert rel(*grads) < 1e-5


def test_without_triton_uses_reference(monkeypatch):
    tensors = problem(17, 20, 33, 5)
    dout = torch.randn(17, 20)
    out, st, grads = run(H.hybrid_gated_mlp, tensors, dout, 6)
    monkeypatch.setattr(H, "use_triton", lambda x: False)  # as on a machine without triton
    out2, st2, grads2 = run(H.hybrid_gated_mlp, tensors, dout, 6)
    assert rel(out, out2) < 1e-5 and all(rel(a, b) < 1e-5 for a, b in zip(grads, grads2))
    for a, b in zip(st, st2):
        assert a.dtype == b.dtype and torch.allclose(a.double(), b.double(), rtol=1e-5)


@pytest.mark.parametrize("launcher", ["spmm", "wgrad"], ids=["forward", "backward"])
def test_a_launch_beyond_the_device_runs_the_reference(monkeypatch, launcher):
    """A launch configuration the GPU cannot run (Triton's OutOfResources) in the forward or the backward: that
    block's gradients (and outputs) come from the reference's dense math, with one warning, and later blocks of
    the shape run the reference without trying the kernels again."""
    from triton.runtime.errors import OutOfResources

    attempts = []

    def beyond_the_device(*args, **kwargs):
        attempts.append(1)
        raise OutOfResources(233472, 232448, "shared memory")

    monkeypatch.setattr(H, launcher, beyond_the_device)
    monkeypatch.setattr(H, "_BEYOND_THE_DEVICE", {"forward": set(), "backward": set()})
    tensors = problem(23, 30, 40, 6)
    dout = torch.randn(23, 30, generator=torch.Generator().manual_seed(1))
    expected = run(hybrid_gated_mlp_reference, [t.double() for t in tensors], dout.double(), 7)
    with pytest.warns(UserWarning, match="out of resource: shared memory.*D 30 / I 40 .*runs the dense reference"):
        out, stats, grads = run(H.hybrid_gated_mlp, tensors, dout, 7)
    for got in (out, stats.l1, *grads):
        assert torch.isfinite(got).all()
    assert rel(out, expected[0]) < 1e-5 and all(rel(g, r) < 1e-5 for g, r in zip(grads, expected[2]))
    assert [g.dtype for g in grads] == [torch.float32] * 4 and int(stats.backup_rows) == int(expected[1].backup_rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = run(H.hybrid_gated_mlp, tensors, dout, 7)
    assert len(attempts) == 1 and all(torch.equal(g, r) for g, r in zip(again[2], grads))


def test_a_backward_beyond_the_device_under_activation_checkpointing(monkeypatch):
    """Two checkpointed blocks of one shape whose backward launch fails: the recomputed forwards stay on the
    kernels (they must save what the original forwards saved) and both blocks' gradients come from the
    reference, the second block's without another attempt."""
    from triton.runtime.errors import OutOfResources

    attempts = []

    def beyond_the_device(*args, **kwargs):
        attempts.append(1)
        raise OutOfResources(233472, 232448, "shared memory")

    monkeypatch.setattr(H, "wgrad", beyond_the_device)
    monkeypatch.setattr(H, "_BEYOND_THE_DEVICE", {"forward": set(), "backward": set()})
    tensors = problem(23, 30, 40, 6)
    dout = torch.randn(23, 30, generator=torch.Generator().manual_seed(1))

    def two_blocks(block, x, gate, up, down):
        y, first = block(x, gate, up, down, max_nnz=7)
        out, second = block(y, gate, up, down, max_nnz=7)
        return out, first.l1 + second.l1

    grads = []
    for block, dtype, checkpointed in ((H.hybrid_gated_mlp, torch.float32, True),
                                       (hybrid_gated_mlp_reference, torch.float64, False)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
        with pytest.warns(UserWarning, match="the backward of hybrid") if checkpointed else warnings.catch_warnings():
            out, l1 = (checkpoint(two_blocks, block, *leaves, use_reentrant=False) if checkpointed
                       else two_blocks(block, *leaves))
            ((out * dout.to(dtype)).sum() + L1_COEFF * l1).backward()
        grads.append([t.grad for t in leaves])
    assert len(attempts) == 1 and all(rel(g, r) < 1e-5 for g, r in zip(*grads))


@pytest.mark.gpu
@pytest.mark.parametrize("hot, eps", [(False, 0.0), (True, 0.0), (True, LOG_EPS)])
def test_gpu_bf16_autocast(hot, eps):
    """fp32 master weights under bf16 autocast: outputs and gradients as close to the fp64 reference
    as the dense bf16 block, fp32 gradients; backup rows included (and hot units as dense columns; and the log
    penalty)."""
    tensors = problem(3000, 320, 1100, 20, device="cuda")
    kw = dict(hot_units=torch.arange(0, 1100, 17, device="cuda")) if hot else {}  # 65 units, unit 2 not among them
    kw["l1_eps"] = eps
    dout = torch.randn(3000, 320, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, st, grads = run(H.hybrid_gated_mlp, tensors, dout, 64, **kw)
        # the dense bf16 block under autocast
        dense_out, dst, dgrads = run(hybrid_gated_mlp_reference, tensors, dout, 64, **kw)
    rout, rst, rgrads = run(hybrid_gated_mlp_reference, [t.double() for t in tensors], dout.double(), 64, **kw)
    # stats against the same bf16 gate matmul (fp64 flips units whose pre-activation rounds to ~0)
    assert out.dtype == torch.bfloat16 and int(st.backup_rows) == int(dst.backup_rows) >= 1
    assert torch.equal(st.fired, dst.fired) and abs(st.active.item() - dst.active.item()) < 1e-4
    assert rel(out, rout) < max(1e-2, 2 * rel(dense_out, rout))
    assert rel(st.l1, rst.l1) < 1e-2
    for g, dg, rg in zip(grads, dgrads, rgrads):
        assert g.dtype == torch.float32 and rel(g, rg) < max(1e-2, 2 * rel(dg, rg))


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [0.0, LOG_EPS])
def test_gpu_fp32_matches_and_deterministic(eps):
    tensors = problem(1000, 200, 700, 15, device="cuda")
    dout = torch.randn(1000, 200, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    out, st, grads = run(H.hybrid_gated_mlp, tensors, dout, 32, l1_eps=eps)
    out2, _, grads2 = run(H.hybrid_gated_mlp, tensors, dout, 32, l1_eps=eps)
    rout, _, rgrads = run(hybrid_gated_mlp_reference, [t.double() for t in tensors], dout.double(), 32, l1_eps=eps)
    assert rel(out, rout) < 1e-5 and all(rel(g, rg) < 1e-5 for g, rg in zip(grads, rgrads))
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


@pytest.mark.gpu
@pytest.mark.parametrize("hot", [False, True])
def test_gpu_no_host_sync_and_cuda_graph(hot):
    """Forward and backward (backup rows and hot units included) never synchronize with the host, so a
    whole step captures in a CUDA graph; its replay gives the eager step's results."""
    tensors = problem(1500, 192, 700, 12, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    dout = torch.randn(1500, 192, device="cuda")
    hot_units = torch.tensor([2, 50, 51, 600], device="cuda") if hot else None

    def step():
        for t in leaves:
            t.grad = None
        out, st = H.hybrid_gated_mlp(*leaves, max_nnz=24, hot_units=hot_units)
        ((out * dout).sum() + L1_COEFF * st.l1).backward()
        return out.detach(), st.backup_rows  # a live autograd graph would break the capture below

    torch.cuda.set_sync_debug_mode("error")
    try:
        out, backup = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(backup) >= 1
    eager = [out.clone()] + [t.grad.clone() for t in leaves]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        g_out, _ = step()
    graph.replay()
    for a, b in zip(eager, [g_out] + [t.grad for t in leaves]):
        assert torch.equal(a, b)
