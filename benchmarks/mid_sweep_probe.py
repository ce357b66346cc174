"""Mid-size (65-768 tokens) launch sweep, source of results/mid_sweep_h100.json: gate kernel (BM, tile
stride, warps, stages) and out kernel (CH, BD, warps) separately, CUDA-graph replays of 8 layer copies, per layer; out configs checked."""
import json, os, sys, torch, triton
sys.path.insert(0, "benchmarks")
from triton.testing import do_bench_cudagraph
import twell
G = sys.modules["twell.gated_mlp"]
from twell.format import empty_twell, slots
from bench_inference import make_layer, make_x, dense, LAYERS, reference, rel_err, twell_out
torch.manual_seed(0)
def bench(fn):
    return do_bench_cudagraph(fn, rep=30, return_mode="median") / LAYERS * 1e3
def gate_pack(x, gate, tile, cfg, ts):
    tw = empty_twell(x.shape[0], gate.shape[0], tile, 8, x.dtype, x.device)
    if ts != tile:
        n = triton.cdiv(gate.shape[0], ts)
        tw = type(tw)(torch.empty(x.shape[0], n, tw.values.shape[2], dtype=x.dtype, device=x.device),
                      torch.empty(x.shape[0], n, tw.values.shape[2], dtype=torch.int32, device=x.device),
                      torch.empty(x.shape[0], n, dtype=torch.int32, device=x.device), tile, gate.shape[0])
    G.gate_launch(x, gate, None, tile, tw.values.shape[2], x.dtype, cfg, tile_stride=ts)(x, gate, gate, *tw[:3], tw.values)
    return tw, tw.values
rows = []
for d, i in ((896, 4864), (2048, 5632), (4096, 14336)):
    layers = [make_layer(d, i, 29) for _ in range(LAYERS)]
    for m in (65, 96, 192, 384, 768):
        x = make_x(m, d)
        ref = reference(x, layers[0])
        td = bench(lambda: [dense(x, lw) for lw in layers])
        tcub = bench(lambda: [x @ lw["gate"].t() for lw in layers])
        line = f"{d}/{i} M={m}: dense {td:.1f} cublas-gate {tcub:.1f} | gate"
        for bm, ts, nw, st in ((128, 128, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (128, 64, 4, 3), (64, 64, 4, 4), (64, 128, 8, 3)):
            cfg = dict(BM=bm, BK=64, GROUP_M=8, num_warps=nw, num_stages=st)
            try:
                t = bench(lambda: [gate_pack(x, lw["gate"], 128, cfg, ts) for lw in layers])
            except Exception as e:
                line += f" {bm}/{ts}/{nw}/{st} fail"; continue
            rows.append(dict(D=d, I=i, M=m, kernel="gate", BM=bm, TS=ts, warps=nw, stages=st, us=t))
            line += f" {bm}/{ts}/{nw}/{st} {t:.1f}"
        print(line, flush=True)
        packed = [gate_pack(x, lw["gate"], 128, G.gate_config(m, 128, 2, False), 128) for lw in layers]
        bd_full = triton.next_power_of_2(d)
        line = "   out CH/BD/w:"
        for ch in (4, 8, 16):
            for bd in (bd_full, 512, 256, 128):
                if bd > bd_full: continue
                for nw in (2, 4, 8):
                    cfg = dict(CH=ch, BD=bd, num_warps=nw)
                    try:
                        out = twell_out(x, packed[0], layers[0], cfg)
                        err = rel_err(out, ref)
                        t = bench(lambda: [twell_out(x, p, lw, cfg) for p, lw in zip(packed, layers)])
                    except Exception as e:
                        line += f" {ch}/{bd}/{nw} fail"; continue
                    rows.append(dict(D=d, I=i, M=m, kernel="out", CH=ch, BD=bd, warps=nw, us=t, err=err))
                    line += f" {ch}/{bd}/{nw} {t:.1f}" + ("!" if err > 5e-3 else "")
        print(line, flush=True)
        rows.append(dict(D=d, I=i, M=m, kernel="dense", us=td)); rows.append(dict(D=d, I=i, M=m, kernel="cublas_gate", us=tcub))
    del layers
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
          open(os.environ["OUT"] + "/mid_sweep_h100.json", "w"), indent=1)
