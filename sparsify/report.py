"""Terminal tables (rich) and PNG plots (matplotlib, Agg: no display needed) shared by `convert` and
`analyze`."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from twell.layer_plan import ALL_TOKENS, LayerPlan

LOG_WIDTH = 1000  # columns outside a terminal: wider than any table, which takes only its natural width

console = Console(stderr=True)
# elsewhere than in a terminal (a log file, CI) lines, titles and captions stay whole: rich would break them at 80
# columns, mid-phrase; and tables keep each row on one line, where rich would squash and wrap them into 80 columns
# (COLUMNS, where set, still decides)
console.soft_wrap = not console.is_terminal
if not console.is_terminal and "COLUMNS" not in os.environ:
    console.width = LOG_WIDTH


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {message}")


def describe(layer: LayerPlan | None) -> str:
    """Short text of a layer's setting for tables: 'T256 C8', 'T128 C8 at 1-64, 700+', 'dense', or '-' for
    none (a model that is not converted)."""
    if layer is None:
        return "-"
    if not layer.is_sparse:
        return "dense"
    where = "" if layer.sparse_tokens == ALL_TOKENS else " at " + ", ".join(
        f"{lo}+" if hi is None else f"{lo}-{hi}" for lo, hi in layer.sparse_tokens)
    return f"T{layer.tile} C{layer.compression}{where}"


# Outside a terminal, a progress line is printed each time this share more of the items is done and at least
# LOGGED_SECONDS have passed since the last line (a few seconds' evaluation: its last line alone), and at the end.
LOGGED_SHARE = 0.1
LOGGED_SECONDS = 10


class _LogPace:
    """When a progress line is due outside a terminal: at the end (once), else after LOGGED_SHARE more of the
    `total` and LOGGED_SECONDS since the last line."""

    def __init__(self, total: int):
        self.total, self.shown, self.started = total, 0, time.perf_counter()
        self.last = self.started

    def due(self, done: int) -> bool:
        now = time.perf_counter()
        if self.shown >= self.total or not (done >= self.total or done - self.shown >= LOGGED_SHARE * self.total
                                            and now - self.last >= LOGGED_SECONDS):
            return False
        self.shown, self.last = done, now
        return True


def batch_progress(items: list, label: str):
    """`items`, shown as a progress bar "label: i/n batches" while they are consumed (gone when done); where the
    output is no terminal, as timestamped lines instead (_LogPace)."""
    if not console.is_terminal:
        pace = _LogPace(len(items))
        for done, item in enumerate(items, 1):
            yield item
            if pace.due(done):
                console.print(timestamped(f"{label}: {done}/{len(items)} batches", time.perf_counter() - pace.started,
                                          done, len(items)), soft_wrap=True)
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=None), MofNCompleteColumn(),
                  TextColumn("batches"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                  transient=True) as progress:
        yield from progress.track(items, total=len(items))


@contextmanager
def token_progress(total: int, label: str):
    """A function that advances a progress bar "label: done/total tokens, tokens/s" by its argument (gone when
    done); where the output is no terminal, timestamped lines instead (_LogPace)."""
    started, done = time.perf_counter(), 0

    def rate() -> str:
        return f"{done / max(time.perf_counter() - started, 1e-9):,.0f} tokens/s"

    if not console.is_terminal:
        pace = _LogPace(total)

        def advance(tokens: int) -> None:
            nonlocal done
            done += tokens
            if pace.due(done):
                console.print(timestamped(f"{label}: {min(done, total):,}/{total:,} tokens, {rate()}",
                                          time.perf_counter() - started, min(done, total), total), soft_wrap=True)

        yield advance
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=None),
                  TextColumn("{task.completed:,}/{task.total:,} tokens, {task.fields[rate]}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task(label, total=total, rate="")

        def advance(tokens: int) -> None:
            nonlocal done
            done += tokens
            progress.update(task, advance=tokens, rate=rate())

        yield advance


def timestamped(text: str, seconds: float, done: int, total: int) -> str:
    """A whole line for output that is no terminal (a file, nohup, a batch job), where progress bars do not show:
    the wall-clock time, `text` and the time left at the pace so far (`seconds` for `done` of `total`)."""
    left = seconds / done * (total - done)
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {text}  "
            f"eta {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}")


def layer_table(layer_stats: list[dict], plan: list[LayerPlan | None], title: str,
                hybrid_share: list[float] | None = None) -> Table:
    """Per layer: active units per token (mean / median / p99 / max), sparsity, dead units, the p99.9 of active
    units per (token, tile) at the planned tile (else the widest measured) and the planned kernel setting (None:
    "-"); with `hybrid_share` (convert), the share of training steps the layer spent on the hybrid kernels, if any
    did; under it, the whole model's mean (what the model card and the docs call its sparsity)."""
    show_hybrid = any(hybrid_share or [])
    units = layer_stats[0]["units"]
    mean = sum(s["mean_active"] for s in layer_stats) / len(layer_stats)
    why_dense = {}  # the planner's reason for a dense layer, where it gives one (a shape its cost model lacks)
    for i, p in enumerate(plan):
        if p is not None and not p.is_sparse and p.stats.get("reason"):
            why_dense.setdefault(p.stats["reason"], []).append(i)
    table = Table(title=f"{title}; active units per token of {units}",
                  caption=f"all layers: {mean:.1f} of {units} units active per token on average "
                          f"({100 * (1 - mean / units):.2f}% sparse); dead: units that fire on none of these tokens; "
                          f"tile p99.9: a token's active units within one tile of that width, 99.9th percentile "
                          f"(the slots a tile needs)" + "".join(
                              "; dense " + ("everywhere" if len(layers) == len(plan) else
                                            "in layers " + ", ".join(map(str, layers))) + f": {reason}"
                              for reason, layers in why_dense.items()))
    for column in ("layer", "mean", "median", "p99", "max", "sparsity %", "dead %", "tile p99.9", "setting"):
        table.add_column(column, justify="right")
    if show_hybrid:
        table.add_column("hybrid steps %", justify="right")
    for i, (s, p) in enumerate(zip(layer_stats, plan)):
        planned_tile = p.tile if p is not None else None  # None: a model that is not converted
        tile = str(planned_tile or max((int(t) for t in s["tiles"]), default=""))
        table.add_row(
            str(i), f"{s['mean_active']:.1f}", f"{s['median_active']:.0f}", f"{s['p99_active']:.0f}",
            str(s["max_active"]), f"{100 * s['sparsity']:.2f}", f"{100 * s['dead_frac']:.1f}",
            f"{s['tiles'][tile]['p999']}/{tile}" if tile else "-", describe(p),
            *([f"{100 * hybrid_share[i]:.0f}"] if show_hybrid else []),
        )
    return table


def perplexity_table(perplexities: dict[str, float]) -> Table:
    table = Table(title="perplexity on held-out text")
    for name in perplexities:
        table.add_column(name, justify="right")
    table.add_row(*(f"{v:.3f}" for v in perplexities.values()))
    return table


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(log: list[dict], path: str | Path) -> None:
    """Sparsity per layer over training (left; one line per layer, darker = deeper) and the loss terms
    (right)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    tokens = [e["tokens"] for e in log]
    layers = len(log[0]["layers"]) if log else 0
    for i in range(layers):
        sparsity = [100 * (1 - e["layers"][i]["active"] / e["layers"][i]["units"]) for e in log]
        left.plot(tokens, sparsity, color=plt.cm.viridis(i / max(1, layers - 1)),
                  label=f"layer {i}" if layers <= 12 else None)
    left.set(xlabel="training tokens", ylabel="sparsity % (inactive hidden units)", title="sparsity per layer")
    if 0 < layers <= 12:
        left.legend(fontsize=7)
    right.plot(tokens, [e["cross_entropy"] for e in log], label="cross-entropy")
    right.plot(tokens, [e["loss"] for e in log], label="loss")
    right.set(xlabel="training tokens", title="loss")
    twin = right.twinx()
    twin.plot(tokens, [e["l1"] for e in log], color="tab:red", label="L1")
    twin.set_ylabel("L1", color="tab:red")
    lines = right.get_lines() + twin.get_lines()
    right.legend(lines, [line.get_label() for line in lines], loc="upper right")
    _save(fig, path)


def plot_activity(layer_stats: list[dict], path: str | Path) -> None:
    """Heatmap of mean active units per token, layers x token position (log colour scale), beside the
    per-layer mean / p99 / max."""
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.35 * len(layer_stats) + 3),
                                      gridspec_kw={"width_ratios": [3, 1]})
    grid = np.array([s["position_active"] for s in layer_stats])
    image = left.imshow(np.maximum(grid, 1e-2), aspect="auto", norm=LogNorm(), cmap="magma", interpolation="nearest")
    fig.colorbar(image, ax=left, label="mean active units")
    left.set(xlabel="token position", ylabel="layer", title="active hidden units by token position")
    layers = range(len(layer_stats))
    for key, label in (("mean_active", "mean"), ("p99_active", "p99"), ("max_active", "max")):
        right.plot([max(s[key], 1e-2) for s in layer_stats], layers, marker="o", label=label)
    right.set(xscale="log", xlabel="active units per token", ylim=(len(layer_stats) - 0.5, -0.5), title="per layer")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    _save(fig, path)


def _save(fig, path) -> None:
    """Writes the figure to `path`, its folder made where missing (as --json's is), and closes it."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
