"""Decode path vs batched path at 8-64 tokens on the benchmark and real shapes (CUDA-graph replays of
8 layer copies, per layer), with the current launch configurations; each checked against fp32. Source of
`results/decode_rows_h100.json` and of `twell.gated_mlp.decode_rows` (run before that rule existed, by
setting DECODE_ROWS; forcing decode_rows is the same)."""
import json, os, sys, torch, triton
sys.path.insert(0, "benchmarks")
from triton.testing import do_bench_cudagraph
import twell
from bench_inference import make_layer, make_x, dense, LAYERS, launch_rules, reference, rel_err
torch.manual_seed(0)
def bench(fn):
    return do_bench_cudagraph(fn, rep=30, return_mode="median") / LAYERS * 1e3
rows = []
for d, i in ((896, 4864), (2048, 5632), (2048, 8192), (3584, 18944), (4096, 14336)):
    layers = [make_layer(d, i, 29) for _ in range(LAYERS)]
    for m in (8, 16, 24, 32, 48, 64):
        x = make_x(m, d)
        ref = reference(x, layers[0])
        r = dict(D=d, I=i, M=m, dense_us=bench(lambda: [dense(x, lw) for lw in layers]))
        for path, limit in (("decode", 64), ("batched", 0)):
            with launch_rules(decode_rows=lambda d, width, limit=limit: limit):  # force the path
                out = twell.gated_mlp(x, layers[0]["gate"], layers[0]["up"], layers[0]["down_p"])
                r[path + "_err"] = rel_err(out, ref)
                r[path + "_us"] = bench(lambda: [twell.gated_mlp(x, lw["gate"], lw["up"], lw["down_p"]) for lw in layers])
        rows.append(r)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    del layers
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python benchmarks/decode_rows_probe.py", rows=rows),
          open(os.environ["OUT"] + "/decode_rows_h100.json", "w"), indent=1)
