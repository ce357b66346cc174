"""DecodeGraphs: eager decode-size calls replayed as CUDA graphs. CPU: calls go straight through.
GPU (-m gpu): replays bit-equal to direct calls, signatures, bypasses, overflow counted once per call."""
import copy
import pickle
import sys
import warnings

import pytest
import torch

import twell
from test_twell_gated_mlp import DEV, block


def test_cpu_calls_run_directly():
    graphs = twell.DecodeGraphs()
    x = torch.randn(2, 8)
    seen = []
    fn = lambda a, w: seen.append(a) or a @ w  # noqa: E731
    w = torch.randn(8, 8)
    for _ in range(3):
        torch.testing.assert_close(graphs(fn, x, w), x @ w, rtol=0, atol=0)
    assert all(a is x for a in seen) and len(graphs) == 0


def test_a_failed_capture_runs_its_signature_directly(monkeypatch):
    """A signature whose capture raises warns once and then runs directly, without another capture."""
    graphs_module = sys.modules["twell.graphs"]
    attempts = []

    def failing_capture(*args):
        attempts.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module, "_Graph", failing_capture)
    monkeypatch.setattr(twell.DecodeGraphs, "graphable", lambda self, x, *args: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    graphs = twell.DecodeGraphs()
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = lambda a, b: a @ b  # noqa: E731  (one function: it is part of the signature)
        results = [graphs(fn, x, w) for _ in range(4)]
    assert len(attempts) == 1 and len(graphs) == 0
    assert [str(w.message) for w in caught if "could not be captured" in str(w.message)] == [
        "twell: a decode call of shape (2, 8) could not be captured as a CUDA graph, so calls like it run directly "
        "(operation not permitted when stream is capturing)"]
    for result in results:
        torch.testing.assert_close(result, x @ w, rtol=0, atol=0)


def test_copies_start_empty():
    graphs = twell.DecodeGraphs(rows=8, capacity=4)
    for clone in (copy.deepcopy(graphs), pickle.loads(pickle.dumps(graphs))):
        assert (clone.rows, clone.capacity, len(clone)) == (8, 4, 0)


def _decode_block(m, **kwargs):
    x, gate, up, down = block(m, 512, 1536, k=20, dtype=torch.bfloat16, **kwargs)
    return x, gate, up, twell.prepare_down(down)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_replays_match_direct_calls(m):
    """First call direct, second captured, then replays: each bit-equal to a direct call on its own input,
    and each output its own tensor (a later call does not overwrite it)."""
    x, gate, up, down = _decode_block(m)
    graphs = twell.DecodeGraphs()
    outs, inputs = [], [x + 0.01 * n * torch.randn_like(x) for n in range(5)]
    for n, xn in enumerate(inputs):
        outs.append(graphs(twell.gated_mlp, xn, gate, up, down))
        assert len(graphs) == (1 if n >= 1 else 0)
    for xn, out in zip(inputs, outs):
        assert torch.equal(out, twell.gated_mlp(xn, gate, up, down))
    assert len({o.data_ptr() for o in outs}) == len(outs)
    # a strided view of the same values takes the same graph
    wide = torch.zeros(m, 2 * x.shape[1], dtype=x.dtype, device=DEV)
    wide[:, ::2] = inputs[0]
    assert torch.equal(graphs(twell.gated_mlp, wide[:, ::2], gate, up, down), outs[0]) and len(graphs) == 1


@pytest.mark.gpu
def test_gpu_weights_moved_or_changed_in_place():
    x, gate, up, down = _decode_block(1)
    graphs = twell.DecodeGraphs()
    for _ in range(3):
        graphs(twell.gated_mlp, x, gate, up, down)
    up.mul_(-1.0)  # read at replay: the captured graph sees the new values
    assert torch.equal(graphs(twell.gated_mlp, x, gate, up, down), twell.gated_mlp(x, gate, up, down))
    moved = up.clone()  # another address: another signature, first run directly
    moved.mul_(0.5)
    for _ in range(3):
        assert torch.equal(graphs(twell.gated_mlp, x, gate, moved, down), twell.gated_mlp(x, gate, moved, down))
    assert len(graphs) == 2


@pytest.mark.gpu
def test_gpu_bypasses_and_inference_mode():
    x, gate, up, down = _decode_block(8)
    graphs = twell.DecodeGraphs(rows=4)
    for _ in range(3):  # more rows than `rows`
        graphs(twell.gated_mlp, x, gate, up, down)
    assert len(graphs) == 0
    graphs = twell.DecodeGraphs()
    expected = twell.gated_mlp(x, gate, up, down)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(graphs(twell.gated_mlp, x, gate, up, down), expected)
    assert len(graphs) == 1
    assert torch.equal(graphs(twell.gated_mlp, x, gate, up, down), expected)  # outside inference mode again
    # parameters (as a model's weights are) are plain tensors here; outside no_grad they record autograd
    params, by_params = [torch.nn.Parameter(w) for w in (gate, up, down)], twell.DecodeGraphs()
    for _ in range(3):
        by_params(twell.gated_mlp, x, *params)
    assert len(by_params) == 0
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(by_params(twell.gated_mlp, x, *params), expected)
    assert len(by_params) == 1
    # autograd recording and an enclosing capture both run directly
    xg = x.clone().requires_grad_()
    detached = lambda a, *w: twell.gated_mlp(a.detach(), *w)  # noqa: E731
    for _ in range(3):
        graphs(detached, xg, gate, up, down)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        out = graphs(twell.gated_mlp, x, gate, up, down)
    out.fill_(float("nan"))
    outer.replay()
    assert torch.equal(out, expected) and len(graphs) == 1


@pytest.mark.gpu
def test_gpu_overflow_counted_once_per_call():
    x, gate, up, down = _decode_block(4)
    x[-1, 0] = -40.0  # every unit of the last row active: each of its tiles overflows
    per_call = torch.zeros(1, dtype=torch.int64, device=DEV)
    expected = twell.gated_mlp(x, gate, up, down, overflow=per_call)
    assert per_call.item() > 0
    graphs, overflow = twell.DecodeGraphs(), torch.zeros(1, dtype=torch.int64, device=DEV)
    for _ in range(4):
        assert torch.equal(graphs(twell.gated_mlp, x, gate, up, down, overflow=overflow), expected)
    assert overflow.item() == 4 * per_call.item() and len(graphs) == 1
