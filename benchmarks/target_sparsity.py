"""Fixed L1 weights against the weight steered to a sparsity (--target-sparsity) and against fixed weights of the
log penalty (--l1-log-scale), on one source: each setting
converted through the CLI (`python -m cli convert SOURCE -o WORK/NAME --no-measure --overwrite -q ARGS ...`; a
folder already holding a checkpoint is read, not converted again), then from each checkpoint's config.json and
training_log.json the held-out perplexity (original, after the swap, after training), the whole model's sparsity
and each layer's sparsity and dead units on the held-out text, and the training curves of active units and of the
L1 weight's factor (and the units allowed, steered). Writes a JSON and a plot beside it: perplexity over sparsity
(the fixed weights of each penalty joined by a line, the steered ones as points), and active units and the factor
over the steps.

    python benchmarks/target_sparsity.py demo --work /tmp/steer --fixed 0.08 0.16 0.32 --steered 0.98 0.99 \\
        --json benchmarks/results/demo_target_sparsity_cpu.json -- --l1 0.08 --device cpu
    python benchmarks/target_sparsity.py demo --work /tmp/steer --fixed 0.16 0.32 --log 0.32 0.64 --log-steered 0.99 \
        --json benchmarks/results/demo_log_penalty_cpu.json -- --l1 0.08 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from matplotlib.ticker import MaxNLocator

sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
from plots import label_sparsity, pyplot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def convert(source: str, out: Path, args: list[str]) -> None:
    """Converts `source` into `out` with the CLI and `args` unless `out` holds a checkpoint."""
    if not (out / "config.json").is_file():
        done = subprocess.run([sys.executable, "-m", "cli", "convert", source, "-o", str(out), "--no-measure",
                               "--overwrite", "-q", *args], cwd=ROOT)
        if done.returncode:  # the CLI has said why
            raise SystemExit(f"the conversion into {out} failed (exit status {done.returncode})")


def figures(out: Path) -> dict:
    """What a checkpoint folder says of its conversion: settings, perplexities, sparsity and training curves."""
    config = json.loads((out / "config.json").read_text())
    training = config["twell"]["training"]
    units = config["intermediate_size"]
    stats = [layer["stats"] for layer in config["twell"]["layers"]]
    active = [layer["mean_active"] for layer in stats]
    log = json.loads((out / "training_log.json").read_text())["log"]
    return {"l1": training["l1"], "target_sparsity": training["target_sparsity"],
            "l1_log_scale": training.get("l1_log_scale", 0.0),
            "perplexity": training["perplexity"], "sparsity": 1 - sum(active) / len(active) / units,
            "layer_sparsity": [1 - a / units for a in active], "layer_dead": [layer["dead_frac"] for layer in stats],
            "steps": training["steps"],
            "training_seconds": training["seconds"],
            "curve": [{"step": e["step"], "mean_active": e["mean_active"], "l1": e["l1"],
                       "l1_scale": e.get("l1_scale", 1.0),
                       **({"allowed_active": e["allowed_active"]} if "allowed_active" in e else {})} for e in log],
            "units": units}


def plot(runs: list[dict], path: Path) -> None:
    plt = pyplot()
    steering = any(r["target_sparsity"] for r in runs)  # the factor's panel only where a run moves it
    fig, (trade, active, *scale) = plt.subplots(1, 3 if steering else 2, figsize=(15 if steering else 10, 4.5))
    for log_penalty, color in ((False, "gray"), (True, "black")):
        fixed = sorted((r for r in runs if not r["target_sparsity"] and bool(r["l1_log_scale"]) == log_penalty),
                       key=lambda r: r["sparsity"])
        if fixed:
            trade.plot([100 * r["sparsity"] for r in fixed], [r["perplexity"]["after training"] for r in fixed], "o-",
                       color=color, label=f"fixed weight, {'log penalty' if log_penalty else 'L1'}")
        for r in fixed:
            trade.annotate(r["name"], (100 * r["sparsity"], r["perplexity"]["after training"]), fontsize=7,
                           xytext=(4, -10), textcoords="offset points")
    for index, r in enumerate(runs):
        steered, color = bool(r["target_sparsity"]), f"C{index}"  # a run's colour in every panel
        if steered:
            trade.plot(100 * r["sparsity"], r["perplexity"]["after training"], "s", color=color, label=r["name"])
        label_sparsity(trade, 100 * r["sparsity"], r["perplexity"]["after training"], r["sparsity"])
        steps = [e["step"] for e in r["curve"]]
        style = dict(color=color, linestyle="-" if steered else ":", label=r["name"])
        active.plot(steps, [e["mean_active"] for e in r["curve"]], **style)
        for axis in scale:
            axis.plot(steps, [e["l1_scale"] for e in r["curve"]], **style)
        if steered:
            active.plot(steps, [e["allowed_active"] for e in r["curve"]], color=color, linestyle="--", linewidth=0.8)
    trade.axhline(runs[0]["perplexity"]["original"], color="black", linestyle="--", linewidth=1, label="original")
    trade.set(xlabel="FFN sparsity on held-out text (%)", ylabel="held-out perplexity after training")
    trade.xaxis.set_major_locator(MaxNLocator(6))
    active.set(xlabel="optimizer step", ylabel="active units a token (training; dashed: allowed)", yscale="log")
    for axis in scale:
        axis.set(xlabel="optimizer step", ylabel="the L1 weight's factor")
    for axis in (trade, active, *scale):
        axis.legend(fontsize=7)
    fig.suptitle("Fixed L1 weights, the weight steered to a sparsity, and the log penalty")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="what `sparsify convert` converts (demo, a folder or a Hub id)")
    ap.add_argument("--work", type=Path, required=True, help="where the checkpoints are written (and read back)")
    ap.add_argument("--fixed", type=float, nargs="*", default=[], help="fixed L1 weights (--l1) to convert at")
    ap.add_argument("--steered", type=float, nargs="*", default=[], help="targets (--target-sparsity) to convert at, "
                                                                          "from the --l1 of the shared arguments")
    ap.add_argument("--log", type=float, nargs="*", default=[], help="fixed weights (--l1) of the log penalty")
    ap.add_argument("--log-steered", type=float, nargs="*", default=[],
                    help="targets (--target-sparsity) to convert at with the log penalty, from the shared --l1")
    ap.add_argument("--log-scale", type=float, default=0.2, help="--l1-log-scale of the --log and --log-steered runs")
    ap.add_argument("--json", type=Path, required=True, help="the report; the plot beside it (.png)")
    ap.epilog = "Arguments after -- go to every conversion."
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.convert_args = argv[cut + 1:]
    settings = [(f"l1 {w:g}", ["--l1", str(w)]) for w in args.fixed] + \
               [(f"target {t:g}", ["--target-sparsity", str(t)]) for t in args.steered] + \
               [(f"log {w:g}", ["--l1", str(w), "--l1-log-scale", str(args.log_scale)]) for w in args.log] + \
               [(f"log target {t:g}", ["--target-sparsity", str(t), "--l1-log-scale", str(args.log_scale)])
                for t in args.log_steered]
    runs = []
    for name, extra in settings:
        out = args.work / name.replace(" ", "_")
        # the setting's own option after the shared ones: where both give --l1, the setting's wins
        convert(args.source, out, [*args.convert_args, *extra])
        runs.append({"name": name, "command": " ".join(["sparsify convert", args.source, "-o", out.name,
                                                        *args.convert_args, *extra]), **figures(out)})
        r = runs[-1]
        print(f"{name}: {100 * r['sparsity']:.2f}% sparse, perplexity {r['perplexity']['original']:.2f} -> "
              f"{r['perplexity']['after training']:.2f}, worst layer {100 * max(r['layer_dead']):.1f}% dead, "
              f"L1 factor at the end {r['curve'][-1]['l1_scale']:.2f}")
    report = {"command": " ".join(["python benchmarks/target_sparsity.py", *argv]),
              "cpu": f"{os.cpu_count()} cores, {platform.machine()}",
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__, "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    plot(runs, args.json.with_suffix(".png"))
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
