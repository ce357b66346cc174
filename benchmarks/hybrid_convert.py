"""GPU check of `sparsify convert`'s per-layer routing to the hybrid training kernels: the same short
conversion twice from the same seed, once with the routing on (a layer trains on twell.training while its
mean active units per token are below --hybrid-below) and once dense only (hybrid_below = 0), on CUDA
with bf16 autocast (what convert uses on a GPU). Both runs go through sparsify.convert.convert, so they
load, relufy, train, measure and export exactly as the command does (the checkpoints go to a temporary
folder). Logs every step, so the JSON has the per-step loss of both runs, each layer's path, active
units and backup rows over time, and tokens/s of both; the printed table puts the losses side by side.

    python benchmarks/hybrid_convert.py --json out.json                 # demo model and corpus, CUDA
    python benchmarks/hybrid_convert.py --source DIR --data FILES --l1 2e-5 --json out.json
    TRITON_INTERPRET=1 python benchmarks/hybrid_convert.py --device cpu --steps 3 --seq-len 32 \\
        --batch-size 2 --eval-tokens 256 --hybrid-below 1000 --hybrid-max-nnz 4   # CPU smoke run

Settings left out come from --recipe if given, else from DEFAULTS below (not from recipes/demo.yaml:
the check needs its own short, fixed setting); log_every is always 1. Tokens/s are medians of the
per-step rates after the first --skip-steps steps (allocator warm-up), over all those steps and over the
steps where the routed run had layers on the hybrid kernels (the same steps of both runs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network: local sources only

import torch  # noqa: E402

from sparsify.config import RunOptions  # noqa: E402
from sparsify.recipe import load_recipe  # noqa: E402
from sparsify.convert import convert  # noqa: E402
from sparsify.train import TrainConfig, hybrid_kernels_run, on_cpu  # noqa: E402

# Used where neither the command line nor a recipe sets them: a short run on the demo model (528 units a
# layer) with the demo recipe's L1 coefficient; hybrid_below stays at the product default (40). The layers
# start well above that threshold and the L1 term brings them below it at different steps, some not within
# the run: the routed run switches layers to the hybrid kernels as it goes and has dense ones beside them.
DEFAULTS = {"steps": 300, "seq_len": 256, "batch_size": 8, "lr": 1e-3, "l1": 5e-2, "l1_warmup_steps": 50,
            "warmup_steps": 20, "eval_tokens": 16384}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "accelerate"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    try:
        found["sparsify_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                  cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        found["sparsify_commit"] = None
    return found


def median_tokens_per_s(run: dict, steps: set[int]) -> float | None:
    """Median of the per-step training rates over `steps`: robust to the one-off Triton compilation of
    the hybrid kernels at the step where the first layer switches."""
    rates = sorted(r for step, r in zip(run["steps"], run["tokens_per_s_per_step"]) if step in steps)
    return rates[len(rates) // 2] if rates else None


def run_summary(summary: dict) -> dict:
    log = summary["log"]
    return {
        "config": summary["training"],
        "perplexity": summary["perplexity"],
        "steps": [e["step"] for e in log],
        "loss": [e["loss"] for e in log],
        "cross_entropy": [e["cross_entropy"] for e in log],
        "mean_active": [e["mean_active"] for e in log],
        "layers_on_hybrid": [sum(l["path"] == "hybrid" for l in e["layers"]) for e in log],
        "layers": [
            {"path": [e["layers"][i]["path"] for e in log], "active": [e["layers"][i]["active"] for e in log],
             "backup_rows": [e["layers"][i]["backup_rows"] for e in log],
             "hot_units": [e["layers"][i].get("hot_units", 0) for e in log], "hybrid_share": summary["hybrid_share"][i]}
            for i in range(len(log[0]["layers"]))
        ],
        "tokens_per_s_per_step": [e["tokens_per_s"] for e in log],
        "seconds": summary["training"]["seconds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="demo", help="Model to convert (as for `sparsify convert`).")
    ap.add_argument("--data", default=None, help="Training text (default for demo: the demo corpus).")
    ap.add_argument("--recipe", default=None,
                    help="Recipe (a YAML path or a name in recipes/); the options below override it.")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="Write the results here.")
    ap.add_argument("--skip-steps", type=int, default=10, help="First steps left out of the tokens/s medians.")
    ap.add_argument("--print-every", type=int, default=None,
                    help="Steps between rows of the printed table (default: steps/20).")
    for name, kind in (("steps", int), ("seq_len", int), ("batch_size", int), ("grad_accum", int), ("lr", float),
                       ("l1", float), ("l1_warmup_steps", int), ("warmup_steps", int), ("eval_tokens", int),
                       ("seed", int), ("hybrid_below", float), ("hybrid_max_nnz", int), ("l1_log_scale", float)):
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    args = ap.parse_args()
    from transformers.utils import logging
    logging.disable_progress_bar()  # as the command does: loading bars would bury the table
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or pass --device cpu for a smoke run")

    settings = {**DEFAULTS, **(load_recipe(args.recipe, args.source) if args.recipe else {})}
    settings.update({k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None})
    settings["log_every"] = 1
    hybrid_config = TrainConfig.from_dict(settings)
    dense_config = TrainConfig.from_dict({**settings, "hybrid_below": 0})
    device = torch.device("cpu" if on_cpu(args.device) else args.device)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in (("hybrid", hybrid_config), ("dense", dense_config)):
            print(f"{name} run: {config.steps} steps, hybrid_below {config.hybrid_below}", flush=True)
            # planned by the cost model, not timed: the training is what is compared
            summary = convert(args.source, config, RunOptions(Path(tmp) / name, data=args.data, device=args.device,
                                                              overwrite=True, quiet=True, measure_kernels=False))
            runs[name] = run_summary(summary)

    hybrid, dense = runs["hybrid"], runs["dense"]
    measured = {step for step in dense["steps"] if step > args.skip_steps}
    while_hybrid = {step for step, n in zip(hybrid["steps"], hybrid["layers_on_hybrid"]) if n and step in measured}
    for run in runs.values():
        run["tokens_per_s"] = median_tokens_per_s(run, measured)
        run["tokens_per_s_while_hybrid"] = median_tokens_per_s(run, while_hybrid)
    loss_rel_diff = [abs(h - d) / abs(d) for h, d in zip(hybrid["loss"], dense["loss"])]
    doc = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "mixed_precision": "no" if device.type == "cpu" else "bf16",
        "hybrid_kernels_run": hybrid_kernels_run(device),
        "versions": versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "source": args.source,
        "data": args.data or "demo corpus",
        "loss_rel_diff": {"max": max(loss_rel_diff), "final": loss_rel_diff[-1]},
        "steps_while_hybrid": len(while_hybrid),
        "runs": runs,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))

    every = args.print_every or max(1, len(dense["steps"]) // 20)
    layers = len(hybrid["layers"])
    print("\nlosses of both runs; mean active units, layers on hybrid, backup rows and hot units of the routed run")
    print(f"{'step':>6} {'loss dense':>11} {'loss hybrid':>12} {'rel diff':>9} {'active':>8} {'hybrid layers':>14} "
          f"{'backup rows':>12} {'hot units':>10}")
    for i, step in enumerate(dense["steps"]):
        if step % every == 0 or i == len(dense["steps"]) - 1:
            backup = sum(l["backup_rows"][i] for l in hybrid["layers"])
            hot = sum(l["hot_units"][i] for l in hybrid["layers"])
            print(f"{step:>6} {dense['loss'][i]:>11.4f} {hybrid['loss'][i]:>12.4f} {loss_rel_diff[i]:>9.2e} "
                  f"{hybrid['mean_active'][i]:>8.1f} {hybrid['layers_on_hybrid'][i]:>10}/{layers:<3} "
                  f"{backup:>12} {hot:>10}")
    print("\nper layer, share of steps on the hybrid path:",
          " ".join(f"{i}:{100 * l['hybrid_share']:.0f}%" for i, l in enumerate(hybrid["layers"])))
    for name, run in runs.items():
        rates = [f"{r:,.0f}" if r else "-" for r in (run["tokens_per_s"], run["tokens_per_s_while_hybrid"])]
        print(f"{name:>6}: median tokens/s {rates[0]} after step {args.skip_steps}, {rates[1]} over the "
              f"{len(while_hybrid)} steps with layers on hybrid; perplexity after training "
              f"{run['perplexity']['after training']:.3f}; {run['seconds']:.0f} s")
    print(f"device {doc['device']}, hybrid kernels run: {doc['hybrid_kernels_run']}, "
          f"max loss rel diff {doc['loss_rel_diff']['max']:.2e}")


if __name__ == "__main__":
    main()
