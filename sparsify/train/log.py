"""The training log: the window of figures summed since the last log entry, the entry made from it, and how it
is shown (a progress bar with the latest figures, or a timestamped line per log step where the output is no
terminal)."""
from __future__ import annotations

import torch
from accelerate import Accelerator
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..report import console, timestamped
from .loss import LossTerms, logged_terms, shown_terms, term_weights
from .state import Run, RunState, StepOutcome


def log_entry(run: Run, state: RunState, window: Window, outcome: StepOutcome, now: float) -> dict:
    """The log entry of the steps since the last one: the window's means over its micro-batches and the
    processes, the dead units, each layer's path and (GPU) the busiest GPU's peak memory."""
    accelerator, config = run.accelerator, run.config
    terms, layer_l1, layer_active, backup_rows = window.reduced(accelerator)
    weights = term_weights(config, outcome.l1_weight)
    tokens = state.step * config.tokens_per_step(run.world)
    dead_window = config.dead_window_tokens or config.tokens_per_step(run.world)
    dead = ((tokens - state.last_fired) >= dead_window).float().mean(dim=1).tolist()
    layers = len(layer_active)
    entry = {
        "step": state.step,
        "tokens": tokens,
        "lr": run.scheduler.get_last_lr()[0],
        "l1_coeff": outcome.l1_weight,
        "loss": terms.loss(weights),
        **logged_terms(terms, weights),
        "mean_active": sum(layer_active) / layers,
        "dead_frac": sum(dead) / layers,
        "layers": [
            {"active": a, "l1": v, "dead_frac": d, "units": state.last_fired.shape[1],
             "path": "hybrid" if m.runs_hybrid else "dense", "backup_rows": b}
            for a, v, d, m, b in zip(layer_active, layer_l1, dead, run.mlps, backup_rows)
        ],
        **_peak_memory(accelerator),
    }
    if config.l1_relative:
        entry["l1_relative"], entry["l1_reference"] = outcome.l1_coeff, state.l1_reference
    if config.target_sparsity:
        entry["l1_scale"] = state.l1_scale
    if outcome.source_share is not None:
        entry["source_share"] = outcome.source_share
    entry["tokens_per_s"] = window.tokens * run.world / (now - window.started)
    entry["seconds"] = now - state.started
    return entry


def _peak_memory(accelerator: Accelerator) -> dict:
    """{"max_memory_gib": the busiest GPU's peak since the last log step} on GPU, {} on CPU."""
    if accelerator.device.type != "cuda":
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device)], device=accelerator.device)
    gib = accelerator.reduce(peak, reduction="max").item() / 2**30
    torch.cuda.reset_peak_memory_stats(accelerator.device)
    return {"max_memory_gib": gib}


class Window:
    """Sums over the micro-batches since the last log entry (on device: no host sync per step), in one tensor so
    that one all-reduce takes them all: the loss terms (LossTerms' fields), then per layer the L1 and the active
    units."""

    def __init__(self, layers: int, device, started: float):
        self.started = started  # time.perf_counter() at the window's start
        self.count = self.tokens = 0
        self.sums = torch.zeros(len(LossTerms._fields) + 2 * layers, device=device)
        self.backup_rows = torch.zeros(layers, dtype=torch.int64, device=device)

    def add(self, terms: LossTerms, layer_l1, layer_active, backup_rows, tokens: int) -> None:
        self.count += 1
        self.tokens += tokens
        self.sums += torch.cat([*(term.detach().float().view(1) for term in terms), layer_l1.detach(), layer_active])
        self.backup_rows += backup_rows

    def reduced(self, accelerator: Accelerator) -> tuple[LossTerms, list[float], list[float], list[int]]:
        """The loss terms, per-layer L1 and per-layer active units as means over the window's micro-batches and
        the processes, and per layer the backup rows summed over them."""
        means = accelerator.reduce(self.sums / self.count, reduction="mean")
        backup_rows = accelerator.reduce(self.backup_rows, reduction="sum").tolist()
        terms, layer_l1, layer_active = means.split([len(LossTerms._fields), len(backup_rows), len(backup_rows)])
        return LossTerms(*terms.tolist()), layer_l1.tolist(), layer_active.tolist(), backup_rows


class _Progress(Progress):
    """A bar line with the latest logged figures on the line below (one line cannot hold both)."""

    stats = "waiting for the first log step"

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        yield self.stats


def progress_bar(enabled: bool, total: int, step: int) -> _Progress | None:
    if not enabled:
        return None
    progress = _Progress(TextColumn("[bold]training"), BarColumn(bar_width=None), MofNCompleteColumn(),
                         TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    progress.add_task("train", total=total, completed=step)
    if console.is_terminal:  # elsewhere (a file, a batch job) each log step prints a whole line instead
        progress.start()
    return progress


def progress_text(e: dict) -> str:
    hybrid = sum(l["path"] == "hybrid" for l in e["layers"])
    return (
        f"{e['tokens']:,} tok  {e['tokens_per_s']:,.0f} tok/s  loss {e['loss']:.3f}  " + shown_terms(e)
        + f"active {e['mean_active']:.1f}" + (f" of {e['allowed_active']:.1f}" if "allowed_active" in e else "")
        + f"  dead {100 * e['dead_frac']:.1f}%"
        + (f"  revived {e['revived']}" if "revived" in e else "")
        + (f"  L1 x{e['l1_scale']:.2f}" if "l1_scale" in e else "")
        + (f"  hybrid {hybrid}/{len(e['layers'])}" if hybrid else "")
        + (f"  mem {e['max_memory_gib']:.1f} GiB" if "max_memory_gib" in e else "")
    )


def log_line(entry: dict, total: int, seconds: float) -> str:
    """The line a log step writes where the output is no terminal: the step and its figures, timestamped with
    the time left at this run's pace (`seconds` for its steps so far)."""
    return timestamped(f"step {entry['step']}/{total}  {progress_text(entry)}", seconds, entry["step"], total)
