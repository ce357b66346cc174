"""The quality pipeline's training runs: conversions and the continued-training control.

A conversion goes through the real command line (`python -m cli convert BASE -o OUT ...` in a subprocess, so that
several run side by side), and its figures are read back from the checkpoint it wrote. The control trains the
source with sparsify's own trainer in this process, on the conversions' batches with their recipe but no swap, no
L1 and no distillation, and saves the trained model beside them so that it is measured as they are. With several
budget shares every run's name carries its share, and a run of several passes over its text (--convert-epochs) its
number of passes, so that the runs of one setting do not share a folder.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPARSE = 0.99  # the sparsity whose first arrival in a conversion's training log is reported
PIPELINE_SETTINGS = ("data",)  # run settings that choose the run's text (convert_quality.py), not training settings


def settings_text(settings: dict, sep: str, without: tuple = ()) -> str:
    """`settings` as "key{sep}value" pairs joined by sep (distill 0, the default, left out)."""
    return sep.join(f"{k}{sep}{v:g}" if isinstance(v, (int, float)) else f"{k}{sep}{v}" for k, v in settings.items()
                    if k not in without and not (k == "distill" and not v))


def budget(share: float | None, epochs: int) -> list[tuple[str, float]]:
    """The budget part of a run's name and label: its share where several are run, its passes over its text
    (--convert-epochs) where more than one."""
    return [("share", share)] * (share is not None) + [("epochs", epochs)] * (epochs > 1)


def run_name(settings: dict, share: float | None = None, epochs: int = 1) -> str:
    """The run's name (its folder, its stage JSON): its settings and budget."""
    return settings_text(settings, "_") + "".join(f"_{k}{v:g}" for k, v in budget(share, epochs))


def control_name(share: float | None = None, epochs: int = 1) -> str:
    return "control" + "".join(f"_{k}{v:g}" for k, v in budget(share, epochs))


def run_label(run: dict, without: tuple = (), share: bool = False, epochs: bool = True) -> str:
    """A conversion's settings in words, its share where `share`, its passes (more than one) where `epochs`."""
    settings = run.get("settings") or {"l1": run["l1_relative"], "distill": run.get("distill", 0.0)}
    return " ".join([settings_text(settings, " ", without), *(
        f"{k} {v:g}" for k, v in budget(run["share"] if share else None,
                                        run.get("epochs", 1) if epochs else 1))]).strip()


def shared_settings(runs: list[dict]) -> dict:
    """The settings that every one of several runs has, with the same value (a plot states them once)."""
    settings = [run.get("settings") or {} for run in runs]
    if len(settings) < 2:
        return {}
    return {k: v for k, v in settings[0].items() if all(k in s and s[k] == v for s in settings[1:])}


def parse_setting(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value = yaml.safe_load(value)
    try:  # YAML 1.1 reads 8e-4 (no dot) as a string
        return key, float(value) if isinstance(value, str) else value
    except ValueError:
        return key, value


def parse_settings(text: str) -> dict:
    return dict(parse_setting(item) for item in text.split(","))


def first_sparse(log: list[dict], units: int) -> dict | None:
    """{"step", "tokens"} of the first training-log entry at SPARSE sparsity or more (mean active units at most
    1 - SPARSE of `units`), None if none is."""
    for entry in log:
        if entry["mean_active"] <= (1 - SPARSE) * units:
            return {"step": entry["step"], "tokens": entry["tokens"]}
    return None


class GpuSlots:
    """The GPUs the conversions run on: each takes the one running the fewest conversions (its subprocess's
    CUDA_VISIBLE_DEVICES set to it), so that --jobs spreads them over a machine's GPUs."""

    def __init__(self, gpus: list[str]):
        self.running = dict.fromkeys(gpus, 0)
        self.lock = threading.Lock()

    @classmethod
    def visible(cls, device: str | None) -> "GpuSlots":
        """The GPUs this process sees (CUDA_VISIBLE_DEVICES's, else every one) when `device` is "cuda"; none for
        another device ("cpu", or a GPU named by its index)."""
        if device != "cuda":
            return cls([])
        import torch

        named = os.environ.get("CUDA_VISIBLE_DEVICES")
        return cls(named.split(",") if named else [str(i) for i in range(torch.cuda.device_count())])

    @contextmanager
    def take(self):
        """The environment a conversion runs in: CUDA_VISIBLE_DEVICES set to the least busy GPU where there are
        several, nothing added otherwise."""
        if len(self.running) < 2:
            yield {}
            return
        with self.lock:
            gpu = min(self.running, key=self.running.get)
            self.running[gpu] += 1
        try:
            yield {"CUDA_VISIBLE_DEVICES": gpu}
        finally:
            with self.lock:
                self.running[gpu] -= 1


_gpu_slots: dict[str | None, GpuSlots] = {}
_gpu_slots_lock = threading.Lock()


def gpu_slots(device: str | None) -> GpuSlots:
    """The one GpuSlots of `device` that every conversion thread shares, made at the first."""
    with _gpu_slots_lock:
        if device not in _gpu_slots:
            _gpu_slots[device] = GpuSlots.visible(device)
        return _gpu_slots[device]


def convert(args, base: Path, corpus: Path, recipe: dict, out: Path, settings: dict, tokens: int) -> dict:
    """One conversion through the command line with `settings` over `recipe`; returns its figures read back
    from the checkpoint. With --jobs above 1 its output goes to OUT.log, and on a machine of several GPUs it
    runs on the least busy one (GpuSlots)."""
    run_recipe = out.with_name(out.name + ".recipe.yaml")
    recipe_settings = {k: v for k, v in settings.items() if k not in PIPELINE_SETTINGS}
    run_recipe.write_text(json.dumps({**recipe, **recipe_settings}, indent=1))  # JSON is YAML
    command = [sys.executable, "-m", "cli", "convert", str(base), "-o", str(out), "--data", str(corpus),
               "--recipe", str(run_recipe), "--tokens", str(tokens), "--seq-len", str(args.seq_len), "--overwrite"]
    if "batch_size" not in settings:  # a run's own batch size (more steps for the same tokens) over --convert-batch
        command += ["--batch-size", str(args.convert_batch)]
    if not args.measure:
        command.append("--no-measure")
    if args.device:
        command += ["--device", args.device]
    print("$", shlex.join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    slots = gpu_slots(args.device)
    started = time.time()
    with (open(out.with_name(out.name + ".log"), "w") if args.jobs > 1 else nullcontext() as output,
          slots.take() as gpu):
        subprocess.run(command, cwd=ROOT, env=env | gpu, check=True, stdout=output,
                       stderr=subprocess.STDOUT if output else None)
    log = json.loads((out / "training_log.json").read_text())
    config = json.loads((out / "config.json").read_text())
    layers = [layer["stats"] for layer in config["twell"]["layers"]]
    units = config["intermediate_size"]
    ppl = log["training"]["perplexity"]
    training = log["training"]
    return {
        "settings": settings, "l1_relative": training["l1"], "distill": training["distill"],
        "command": shlex.join(command[1:]), "seconds": round(time.time() - started, 1),
        "tokens": training["tokens"], "steps": training["steps"], "training_seconds": training["seconds"],
        "cross_entropy": {k: math.log(v) for k, v in ppl.items()}, "perplexity": ppl,
        "ce_vs_original": math.log(ppl["after training"]) / math.log(ppl["original"]) - 1,
        "mean_active": sum(l["mean_active"] for l in layers) / len(layers),
        "sparsity": 1 - sum(l["mean_active"] for l in layers) / len(layers) / units,
        "layers": [{"sparsity": 1 - l["mean_active"] / units, **l} for l in layers],
        "plan": [layer["mode"] for layer in config["twell"]["layers"]],
        "l1_reference": log["log"][0].get("l1_reference"),
        "calibration": training.get("calibration"),  # each layer's fit, with --calibrate-steps
        "log": [{k: e[k] for k in ("step", "tokens", "cross_entropy", "kl", "l1", "mean_active", "dead_frac",
                                   "revived", "source_share", "tokens_per_s") if k in e}
                | {"hybrid_layers": sum(l["path"] == "hybrid" for l in e["layers"])} for e in log["log"]],
    }


def control(args, base: Path, corpus: Path, recipe: dict, tokens: int, out: Path) -> dict:
    """The continued-training control: the source model trained by sparsify's trainer on the conversions'
    batches with their recipe, but no swap, no L1 and no distillation. Its MLPs are ReluGatedMLPs (for
    the trainer's statistics) holding the source activation throughout (source_share 1); the trained model is
    saved to `out` as the plain SiLU model it is (through a temporary folder renamed into place)."""
    import torch

    from sparsify.data import TextData
    from sparsify.load import load_model
    from sparsify.measure import perplexity
    from sparsify.relufy import relufy, unrelufy
    from sparsify.train import TrainConfig, train

    config = TrainConfig.from_dict({**recipe, "batch_size": args.convert_batch, **dict(args.control_overrides),
                                    "l1": 0.0, "distill": 0.0, "distill_hidden": 0.0, "swap_steps": 0,
                                    "hybrid_below": 0.0, "tokens": tokens, "seq_len": args.seq_len})
    model, tokenizer, _ = load_model(str(base), dtype=torch.float32, device=args.device)
    text = TextData(str(corpus), tokenizer, config.seq_len, config.eval_tokens)
    mlps = relufy(model)
    for m in mlps:
        m.source_share = 1.0
    before = perplexity(model, text.eval_blocks, config.batch_size)
    result = train(model, mlps, lambda start, rank, world: text.train_batches(
        config.batch_size, start, rank, world, shuffle_buffer=config.shuffle_buffer, seed=config.seed), config,
        device=args.device, show_progress=False)
    after = perplexity(result.model, text.eval_blocks, config.batch_size)
    print(f"{out.name} (continued SiLU): held-out CE {math.log(before):.4f} -> {math.log(after):.4f}", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    unrelufy(result.model).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"tokens": result.tokens, "steps": result.steps, "training_seconds": round(result.seconds, 1),
            "cross_entropy": {"original": math.log(before), "after training": math.log(after)},
            "log": [{k: e[k] for k in ("step", "tokens", "cross_entropy", "tokens_per_s")} for e in result.log]}


def summary_line(run: dict) -> str:
    """One line of a conversion's figures: sparsity, held-out CE through the stages, against the original and the
    control where there is one, when it first reached SPARSE sparsity, and for several passes over its text the
    tokens trained on and the distinct ones."""
    ce = run["cross_entropy"]
    calibrated = f" -> {ce['after calibration']:.4f} (calibrated)" if "after calibration" in ce else ""
    passes = (f" ({run['tokens']:,} tokens trained on, {run['distinct_tokens']:,} distinct)"
              if run.get("epochs", 1) > 1 else "")
    line = (f"{run['name']}{passes}:"
            f" sparsity {100 * run['sparsity']:.2f}%  held-out CE {ce['original']:.4f} -> {ce['after swap']:.4f} "
            f"(swap){calibrated} -> {ce['after training']:.4f} ({100 * run['ce_vs_original']:+.2f}%"
            + (f", {100 * run['ce_vs_control']:+.2f}% vs control)" if "ce_vs_control" in run else ")"))
    if "first_sparse" in run:
        first = run["first_sparse"]
        line += f"  {SPARSE:.0%} sparse: " + (f"step {first['step']}, {first['tokens']:,} tokens" if first else "never")
    return line
