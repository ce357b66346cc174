"""Fit the cost model of `twell.cost_model` (dense_time, twell_time) to block-benchmark results.

Cases: every row of the given bench_inference.py JSON files without overflow (dense_ms, twell_ms and,
for batched rows, gate_ms and updown_ms), and `bench_inference.py --decode-paths` rows (dense_us and the
time of the path the kernel takes at that size). Each component is fitted on log time (scipy least squares): the
dense block on dense times, the decode path on decode twell times, the gate launch (once per batched gate
kernel, `twell.cost_model.gate_kernel`: the Triton kernel per tile width, the Hopper kernel) and the out launch
separately on the batched breakdown. Prints the constants to paste into kernels/cost_model.py, then, with the
constants currently in kernels/cost_model.py, measured against predicted speed-up per case and the rms error.

  python benchmarks/fit_cost_model.py benchmarks/results/inference_window_h100.json \\
      benchmarks/results/inference_h100.json benchmarks/results/inference_tiles_h100.json \\
      benchmarks/results/decode_rows_h100.json
"""
import argparse
import json

import numpy as np
from scipy.optimize import least_squares

from twell import cost_model as cost
from twell.format import decode_rows
from twell.layer_plan import LayerPlan


def load_cases(paths):
    cases = []
    for path in paths:
        for r in json.load(open(path))["rows"]:
            if "decode_us" in r:  # bench_inference.py --decode-paths: the path the kernel takes at this size
                path_us = r["decode_us"] if r["M"] <= decode_rows(r["D"], r["I"]) else r["batched_us"]
                cases.append(dict(D=r["D"], I=r["I"], M=r["M"], a=29.0, tile=128, dense=r["dense_us"] * 1e-6,
                                  twell=path_us * 1e-6))
            elif "heavy_rows" in r:  # bench_inference.py --robustness: decode-sized cells run on the kernels
                graph = "graph" if r["M"] == 1 else "step_graph"  # one token; a decode step of M sequences
                plan = LayerPlan.from_json(r["plan"])
                if f"{graph}_path" in r:  # the path the timing took
                    sparse = r[f"{graph}_path"] == "kernels"
                else:  # rows that do not record the path: the plan's token windows
                    sparse = plan.is_sparse and any(lo <= r["M"] <= (hi or r["M"]) for lo, hi in plan.sparse_tokens)
                if r["heavy_rows"] == 0 and sparse and f"{graph}_twell_us" in r:
                    cases.append(dict(D=r["D"], I=r["I"], M=r["M"], a=r["active"], tile=plan.tile,
                                      dense=r[f"{graph}_dense_us"] * 1e-6, twell=r[f"{graph}_twell_us"] * 1e-6))
            elif r.get("overflow_tiles", 0) == 0:
                cases.append(dict(D=r["D"], I=r["I"], M=r["M"], a=r["mean_active"], tile=r["tile"],
                                  dense=r["dense_ms"] * 1e-3,
                                  twell=r["twell_ms"] * 1e-3, gate=r.get("gate_ms", np.nan) * 1e-3,
                                  out=r.get("updown_ms", np.nan) * 1e-3))
    return cases


def fit(model, cases, target, x0, lower, upper):
    t = np.array([c[target] for c in cases])
    result = least_squares(lambda p: np.log([model(p, c) for c in cases]) - np.log(t), x0, bounds=(lower, upper))
    return result.x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results", nargs="+")
    cases = load_cases(p.parse_args().results)
    decode = [c for c in cases if c["M"] <= decode_rows(c["D"], c["I"])]
    batched = [c for c in cases if c["M"] > decode_rows(c["D"], c["I"]) and "gate" in c and not np.isnan(c["gate"])]

    def dense(q, c):
        return cost.roofline(6 * c["M"] * c["D"] * c["I"], 6 * c["D"] * c["I"],
                             (q[0] * 1e12, q[1], q[2] * 1e12, q[3] * 1e-6), c["D"])

    def gate(q, c):
        return cost.roofline(2 * c["M"] * c["D"] * c["I"], 2 * c["D"] * c["I"],
                             (q[0] * 1e12, q[1], q[2] * 1e12, q[3] * 1e-6), c["D"])

    def out(q, c):
        h = max(0.0, 1 - cost.L2_BYTES / (4 * c["D"] * c["I"]))
        return (c["M"] * c["a"] * (4 * c["D"] * ((1 - h) / (q[0] * 1e12) + h / (q[1] * 1e12)) + q[2] * 1e-9)
                + q[3] * 1e-6)

    def dec(q, c):
        return cost.decode_time(c["a"], c["D"], c["I"], c["M"], c["tile"], (q[0] * 1e12, q[1] * 1e-6, q[2] * 1e-6))

    d = fit(dense, cases, "dense", [700, 500, 2.5, 10], [100, 0, 0.5, 0], [3000, 5000, 4, 60])
    kernels = {}
    for c in batched:
        kernels.setdefault(cost.gate_kernel(c["tile"], c["M"], c["I"]), []).append(c)
    g = {kernel: fit(gate, group, "gate", [600, 300, 2.5, 5], [100, 0, 0.5, 0], [3000, 5000, 4, 60])
         for kernel, group in sorted(kernels.items(), key=str)}
    o = fit(out, batched, "out", [7, 2.7, 0.2, 20], [1, 0.3, 0, 0], [40, 10, 100, 60])
    k = fit(dec, decode, "twell", [2, 1, 7], [0.5, 0, 0], [4, 20, 60])
    print(f"DENSE = ({d[0]:.0f}e12, {d[1]:.0f}, {d[2]:.2f}e12, {d[3]:.1f}e-6)")
    print("GATE = {" + ", ".join(f"{k!r}: ({q[0]:.0f}e12, {q[1]:.0f}, {q[2]:.2f}e12, {q[3]:.1f}e-6)"
                                 for k, q in g.items()) + "}  # cases: "
          + ", ".join(f"{k!r} {len(v)}" for k, v in kernels.items()))
    print(f"GATHER = ({o[0]:.2f}e12, {o[1]:.2f}e12, {o[2]:.3f}e-9, {o[3]:.1f}e-6)")
    print(f"DECODE = ({k[0]:.2f}e12, {k[1]:.2f}e-6, {k[2]:.1f}e-6)")
    print(f"\nwith the constants in kernels/cost_model.py ({len(cases)} cases):")
    errors = []
    for c in cases:
        measured = c["dense"] / c["twell"]
        predicted = cost.speedup(c["a"], c["D"], c["I"], c["M"], c["tile"])
        errors.append(np.log(predicted / measured))
        side = "" if (measured > 1) == (predicted > 1) else "  other side of 1"
        print(f"{c['D']:5d} {c['I']:6d} {c['M']:6d} T{c['tile']:<3d} {c['a']:6.1f}  measured {measured:5.2f}x  "
              f"predicted {predicted:5.2f}x  {100 * (predicted / measured - 1):+4.0f}%{side}")
    print(f"rms error of log speed-up: {np.sqrt(np.mean(np.square(errors))):.3f}")


if __name__ == "__main__":
    main()
