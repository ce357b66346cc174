"""The quality report's plots: the training curves and the sparsity / cross-entropy trade-off (`plot`), and with
several budget shares or numbers of passes the budget curve (`budget_plot`): each setting's held-out cross-entropy
cost against the original at the end of its run, over the share of the pretraining tokens it was given (a line per
number of passes over them, and with several a panel over the passes), its sparsity written beside each point, the
control's cost beside them.
"""
from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

from runs import SPARSE, run_label, settings_text, shared_settings

SMOOTHING = 0.1  # training curves are means over a trailing window of this share of the run's log entries
LEGEND_WIDTH = 64  # characters a legend line holds before it wraps
TITLE_WIDTH = 110  # characters a line of the title's shared settings holds: a one-panel figure stays narrow


def smoothed(values: list[float], share: float = SMOOTHING) -> list[float]:
    """Trailing means of `values` over a window of `share` of them (each point: the mean of the last ones up to
    it), so that a training curve shows its trend rather than each logged batch's noise."""
    window = max(1, round(share * len(values)))
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def data_limits(values: list[float], top: float | None = None) -> tuple[float, float]:
    """Axis limits around `values` (a tenth of their spread, at least 0.25, beyond each end), at most `top`."""
    pad = max(0.25, 0.1 * (max(values) - min(values)))
    high = max(values) + pad
    return min(values) - pad, high if top is None else min(top, high)


def controls(result: dict) -> list[dict]:
    """The report's control runs: none, the one (one budget share) or one a share (several)."""
    control = result.get("control")
    return [] if not control else control if isinstance(control, list) else [control]


def legend_below(axis) -> None:
    """The axis's legend under it and under its x label (lower where the tick labels have two lines: call it after
    setting them), its labels wrapped, so that long run settings do not cover the data."""
    handles, labels = axis.get_legend_handles_labels()
    two_line_ticks = any("\n" in tick.get_text() for tick in axis.get_xticklabels())
    legend = axis.legend(handles, [textwrap.fill(label, LEGEND_WIDTH) for label in labels], fontsize=7,
                         loc="upper center", bbox_to_anchor=(0.5, -0.22 if two_line_ticks else -0.13),
                         frameon=False)
    legend.set_in_layout(False)  # tight_layout keeps the axes' size; the saved figure grows to hold it (save)


def label_sparsity(axis, x: float, y: float, sparsity: float) -> None:
    """A point's held-out FFN sparsity written beside it."""
    axis.annotate(f"{100 * sparsity:.1f}%", (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict, path: Path) -> None:
    """Four panels: training cross-entropy (smoothed) with the held-out points (the original at the start, each
    converted model and the control at their end), active units per token (smoothed, the held-out measurement at
    the end), dead units (the training log's share of units silent for a step, smoothed; the held-out
    measurement's deadest layer at the end), and the held-out sparsity / cross-entropy trade-off, its axes around
    the runs' points."""
    plt = pyplot()
    runs, shares = result["conversions"], len(result["convert_shares"]) > 1
    common = tuple(shared_settings(runs))  # stated once, in the title
    units = result["pretraining"]["config"]["intermediate_size"]
    fig, (ce, active, dead, trade) = plt.subplots(1, 4, figsize=(21, 4.5))
    original = runs[0]["cross_entropy"]["original"]
    for index, run in enumerate(runs):
        tokens = [e["tokens"] / 1e6 for e in run["log"]]
        line, = ce.plot(tokens, smoothed([e["cross_entropy"] for e in run["log"]]))  # runs named in the next panel
        ce.plot(tokens[-1], run["cross_entropy"]["after training"], "o", color=line.get_color(),
                label=None if index else "converted, held-out")
        active.plot(tokens, smoothed([e["mean_active"] for e in run["log"]]),
                    label=run_label(run, common, share=shares),
                    color=line.get_color())
        active.plot(tokens[-1], run["mean_active"], "o", color=line.get_color())
        dead.plot(tokens, smoothed([100 * e["dead_frac"] for e in run["log"]]), color=line.get_color())
        dead.plot(tokens[-1], max(100 * layer["dead_frac"] for layer in run["layers"]), "o", color=line.get_color())
    for index, control in enumerate(controls(result)):
        tokens = [e["tokens"] / 1e6 for e in control["log"]]
        ce.plot(tokens, smoothed([e["cross_entropy"] for e in control["log"]]), color="black", linewidth=1,
                label=None if index else "control: continued SiLU")
        ce.plot(tokens[-1], control["cross_entropy"]["after training"], "s", color="black",
                label=None if index else "control, held-out")
    ce.plot(0, original, "D", color="black", label="original, held-out")
    ce.axhline(original, color="black", linestyle="--", linewidth=1)
    ce.axhline(original * 1.03, color="gray", linestyle=":", linewidth=1, label="original + 3%")
    ce.set(xlabel="conversion tokens (M)", title="cross-entropy (nats)",
           ylabel=f"lines: training, mean of the last {SMOOTHING:.0%} of the logs")
    active.axhline((1 - SPARSE) * units, color="gray", linestyle=":", linewidth=1, label=f"{SPARSE:.0%} sparse")
    active.set(xlabel="conversion tokens (M)", ylabel=f"mean active units per token (of {units})", yscale="log",
               title="active units: training (lines), held-out (points)")
    dead.axhline(10, color="gray", linestyle=":", linewidth=1)
    dead.set(xlabel="conversion tokens (M)", ylabel="dead units (%)",
             title="dead: training, mean of layers (lines);\nheld-out, deadest layer (points)")
    ce.legend(fontsize=7)
    legend_below(active)
    curves = {}  # one curve per setting other than the L1 weight
    for r in runs:
        curves.setdefault(run_label(r, ("l1", *common), share=shares) or "l1 only", []).append(r)
    for label, curve in curves.items():
        curve.sort(key=lambda r: r["sparsity"])
        trade.plot([100 * r["sparsity"] for r in curve], [100 * r["ce_vs_original"] for r in curve], "o-",
                   label=label)
    legend_below(trade)
    for r in runs:
        trade.annotate(f"l1 {r['l1_relative']:g}", (100 * r["sparsity"], 100 * r["ce_vs_original"]), fontsize=7,
                       xytext=(4, 4), textcoords="offset points")
    trade.axhline(3, color="gray", linestyle=":", linewidth=1)
    trade.axvline(100 * SPARSE, color="gray", linestyle=":", linewidth=1)
    trade.set(xlabel="held-out FFN sparsity (%)", ylabel="held-out CE vs original (%)", title="trade-off",
              xlim=data_limits([100 * r["sparsity"] for r in runs], top=100),
              ylim=data_limits([100 * r["ce_vs_original"] for r in runs]))
    save(fig, result, path, common)


CONTROL_STYLES = ("-", "--", ":", "-.")  # the controls' black lines, one style each


def cost_lines(axis, result: dict, x, label, control_label) -> None:
    """Held-out CE against the original at the end of each run over x(run) on `axis`: the conversions a line per
    label(run), each point's sparsity beside it, the controls a black line per control_label(run)."""
    lines = {}
    for run in result["conversions"]:
        lines.setdefault(label(run), []).append(run)
    for name, line in lines.items():
        line.sort(key=x)
        axis.plot([x(r) for r in line], [100 * r["ce_vs_original"] for r in line], "o-", label=name)
        for r in line:
            label_sparsity(axis, x(r), 100 * r["ce_vs_original"], r["sparsity"])
    lines = {}
    for run in controls(result):
        lines.setdefault(control_label(run), []).append(run)
    for style, (name, line) in zip(itertools.cycle(CONTROL_STYLES), lines.items()):
        line.sort(key=x)
        axis.plot([x(c) for c in line], [100 * (c["cross_entropy"]["after training"] / c["cross_entropy"]["original"]
                                                - 1) for c in line],
                  "s", linestyle=style, color="black", linewidth=1, label=name)
    axis.axhline(0, color="black", linestyle="--", linewidth=1)
    axis.axhline(3, color="gray", linestyle=":", linewidth=1, label="original + 3%")


def control_label(control: dict, share: bool = False, epochs: bool = True) -> str:
    """A control's legend entry: its share where `share`, its passes (more than one) where `epochs`, its sampled
    folder (data=) where it has one."""
    return ("control: continued SiLU" + (f", share {control['share']:g}" if share else "")
            + (f", epochs {control['epochs']}" if epochs and control.get("epochs", 1) > 1 else "")
            + (f", data {control['settings']['data']}" if control.get("settings", {}).get("data") else ""))


def budget_plot(result: dict, path: Path) -> None:
    """Held-out CE against the original at the end of each run over its budget share (log scale), one line per
    setting and number of passes over its text, each point's sparsity beside it; the control's line in black. With
    several numbers of passes (--convert-epochs), a panel over the tokens trained on in shares (the passes; a run on a
    sampled folder at its tokens), one line per setting and share (alone where the report has one share)."""
    plt = pyplot()
    epochs = result.get("convert_epochs", [1])
    shares, tokens = result["convert_shares"], result["convert_tokens"]
    share_tokens = dict(zip(shares, tokens if isinstance(tokens, list) else [tokens]))
    panels = ["share"] * (len(shares) > 1 or len(epochs) == 1) + ["epochs"] * (len(epochs) > 1)
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    common = tuple(shared_settings(result["conversions"]))
    for axis, panel in zip(axes[0], panels):
        if panel == "share":
            cost_lines(axis, result, lambda r: r["share"], lambda r: run_label(r, common), control_label)
            axis.set(xscale="log", xlabel="distinct conversion tokens / pretraining tokens (below: their count)")
            axis.set_title("cost at the end of each run; held-out FFN sparsity beside each point", fontsize=10)
            axis.set_xticks(shares, [f"{s:g}\n{t / 1e6:.3g}M" for s, t in share_tokens.items()])
        else:
            # a run's tokens in shares: its passes, or a sampled folder's tokens (all its passes) over the share's
            cost_lines(axis, result, lambda r: r["tokens"] / share_tokens[r["share"]] if "data" in r.get(
                "settings", {}) else r["epochs"], lambda r: run_label(r, common, share=True, epochs=False),
                       lambda c: control_label(c, share=True, epochs=False))
            axis.set(xscale="log", xlabel="tokens trained on / the share's tokens (passes over the share, or over a "
                                          "sampled folder)")
            axis.set_title("cost at the end of each run over the tokens it trained on; held-out FFN sparsity beside "
                           "each point", fontsize=10)
            axis.set_xticks(epochs, [str(n) for n in epochs])
        axis.set(ylabel="held-out CE vs original (%)")
        axis.minorticks_off()
        legend_below(axis)
    save(fig, result, path, common)


def save(fig, result: dict, path: Path, common: tuple = ()) -> None:
    """Titles the figure with the model and device, and the settings every run shares (left out of the legends)."""
    every = settings_text({k: v for run in result["conversions"][:1] for k, v in run["settings"].items()
                           if k in common}, " ") if common else ""
    fig.suptitle(f"{result['pretraining']['parameters'] / 1e6:.0f}M-parameter SiLU Llama -> sparse ReLU "
                 f"({result['device']})" + (f"\n{textwrap.fill('every conversion: ' + every, TITLE_WIDTH)}"
                                            if every else ""))
    fig.tight_layout()
    for axis in fig.axes:  # the legends left out of the layout (legend_below), back in the saved area
        if axis.get_legend() is not None:
            axis.get_legend().set_in_layout(True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
