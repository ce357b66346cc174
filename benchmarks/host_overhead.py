"""Host-side cost of decode-size calls (M = 1, 8, 64 tokens) of twell.gated_mlp, called directly ("twell")
and through twell.DecodeGraphs as converted checkpoints call it ("twell_graphs"), against the dense block, on a
GPU: wall time per call when issued back to back (what an eager `generate` loop pays) and the host's share of
it, do_bench time (the GPU waits on the host between launches when the host is slower) and CUDA-graph replay
time (the GPU alone).

    python benchmarks/host_overhead.py [--baseline DIR] [--json PATH]

--baseline DIR: another copy of the twell package (e.g. an older commit's kernels/) timed beside this one in
the same process. It is imported first, so its custom ops are the registered ones and it runs its own code.
"""
import argparse
import importlib.util
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

parser = argparse.ArgumentParser()
parser.add_argument("--baseline", help="directory of another twell package to time beside this one")
parser.add_argument("--json", help="write the figures here")
args = parser.parse_args()


def dense(x, gate, up, down):
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.relu(g) * u, down)


variants = {"dense": dense}
if args.baseline:
    spec = importlib.util.spec_from_file_location("twell_baseline", f"{args.baseline}/__init__.py",
                                                  submodule_search_locations=[args.baseline])
    baseline = importlib.util.module_from_spec(spec)
    sys.modules["twell_baseline"] = baseline
    spec.loader.exec_module(baseline)
    variants["baseline"] = baseline.gated_mlp
import twell  # noqa: E402  (after the baseline: see the docstring)

variants["twell"] = twell.gated_mlp
graphs = twell.DecodeGraphs()  # what the modeling file of a converted checkpoint calls
variants["twell_graphs"] = lambda x, *weights: graphs(twell.gated_mlp, x, *weights)

D, I, k = 2048, 5632, 29
torch.manual_seed(0)
gate = torch.randn(I, D, device="cuda") / D**0.5
gate[:, 0] = -torch.special.ndtri(torch.tensor(1 - k / I))
gate, up = gate.bfloat16(), (torch.randn(I, D, device="cuda") / D**0.5).bfloat16()
down = twell.prepare_down((torch.randn(D, I, device="cuda") / k**0.5).bfloat16())
gate_up = torch.cat([gate, up])


def timings(fn):
    for _ in range(20):
        fn()
    rounds = []  # median of 7 rounds: the first calls of a fresh process run slower
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            fn()
        issued = time.perf_counter()  # the host's own time when the GPU keeps up, as launches then queue
        torch.cuda.synchronize()
        rounds.append([(t - start) / 200 * 1e6 for t in (time.perf_counter(), issued)])
    wall, host = sorted(rounds)[3]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return dict(wall_us=round(wall, 1), host_us=round(host, 1),
                do_bench_us=round(do_bench(fn, return_mode="median") * 1e3, 1),
                graph_us=round(do_bench(graph.replay, return_mode="median") * 1e3, 1))


results = []
for m in (1, 8, 64):
    x = torch.randn(m, D, device="cuda", dtype=torch.bfloat16)
    x[:, 0] = 1
    ref = None
    for name, f in variants.items():
        fn = lambda: f(x, gate, up, down)  # noqa: E731
        out = fn()
        if name != "dense":  # every TwELL path gives the same bits
            assert ref is None or torch.equal(out, ref), name
            ref = out
        r = dict(m=m, path=name, **timings(fn))
        results.append(r)
        print(f"M={m} {name}: {r['wall_us']} us a call issued back to back (host {r['host_us']}), "
              f"do_bench {r['do_bench_us']} us, CUDA-graph replay {r['graph_us']} us")

if args.json:
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), command=" ".join(sys.argv), D=D, I=I, k=k)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
