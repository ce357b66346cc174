"""Block time against the slot count (tile, compression), with and without outlier rows (one row in 2048
with about a third of its units active, like the first token of each sequence), M 16384, D 2048, I 5632,
k 29. Writes $OUT/slots_probe.json (committed as results/slots_probe_h200.json).

    cd benchmarks && OUT=results python slots_probe.py
"""
import sys, json, os, torch
sys.path.insert(0, "benchmarks")
from triton.testing import do_bench
import twell
G = sys.modules["twell.gated_mlp"]
from bench_inference import make_layer, make_x, gate_pack, twell_out, dense
M, D, I = 16384, 2048, 5632
w = make_layer(D, I, 29)
rows = []
for outliers in (False, True):
    x = make_x(M, D)
    if outliers:
        x[::2048, 0] = 0.2
    td = do_bench(lambda: dense(x, w), warmup=25, rep=100, return_mode="median")
    for tile, c in ((128, 8), (128, 4), (128, 2), (256, 16), (256, 8), (256, 4), (64, 4), (64, 2)):
        cfg_g = G.gate_config(M, tile, 2, False)
        packed = gate_pack(x, w["gate"], tile, c, cfg_g)
        s = packed[0].values.shape[2]
        ovf = (packed[0].counts > s).sum().item()
        tg = do_bench(lambda: gate_pack(x, w["gate"], tile, c, cfg_g), warmup=25, rep=100, return_mode="median")
        to = do_bench(lambda: twell_out(x, packed, w, G.out_config(M, D, False)), warmup=25, rep=100, return_mode="median")
        t = do_bench(lambda: twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=tile, compression=c), warmup=25, rep=100, return_mode="median")
        r = dict(outliers=outliers, tile=tile, compression=c, slots=s, overflowing_pairs=ovf, dense_ms=td, gate_ms=tg, out_ms=to,
                 block_ms=t, speedup=td / t, max_per_tile=packed[0].counts.max().item())
        rows.append(r)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
               command="python benchmarks/slots_probe.py", rows=rows), open(os.environ["OUT"] + "/slots_probe.json", "w"), indent=1)
