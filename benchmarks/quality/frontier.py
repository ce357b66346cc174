"""The sparsity / cost frontier of one budget across quality reports (convert_quality.py's JSONs): every conversion
at --share of its base's pretraining, held-out cross-entropy cost against its own original over its FFN sparsity,
a marker per report; the runs that no other run beats on both (more sparse and less cost) joined as the frontier,
numbered, and listed below the plot with the settings that set them apart; the target (--sparsity and --cost)
shaded. The frontier is printed as a table. Bases of one chain pretrained again differ a little, so points of
different reports compare within that spread.

    python benchmarks/quality/frontier.py benchmarks/results/quality_budget5_*_d1024_h200.json --share 0.05 \\
        --out benchmarks/results/quality_budget5_frontier_d1024_h200.png
"""
from __future__ import annotations

import argparse
import itertools
import json
import textwrap
from pathlib import Path

from plots import pyplot
from runs import run_label, settings_text, shared_settings


def points(results: dict[str, dict], share: float) -> list[dict]:
    """Every conversion at `share` of the reports: its report's name, sparsity and cost (%), and the run."""
    return [{"report": name, "sparsity": 100 * c["sparsity"], "cost": 100 * c["ce_vs_original"], "run": c}
            for name, result in results.items() for c in result["conversions"]
            if abs(c.get("share", result.get("convert_shares", [share])[0]) - share) < 1e-9]


def frontier(found: list[dict]) -> list[dict]:
    """The points that no other point beats on both sparsity (higher) and cost (lower), by sparsity."""
    kept, best = [], float("inf")
    for p in sorted(found, key=lambda p: (-p["sparsity"], p["cost"])):
        if p["cost"] < best:
            kept.append(p)
            best = p["cost"]
    return kept[::-1]


def labels(front: list[dict]) -> list[str]:
    """Each frontier point's settings less those every frontier point shares, with its passes."""
    common = tuple(shared_settings([p["run"] for p in front])) if len(front) > 1 else ()
    return [run_label(p["run"], common) or settings_text(p["run"].get("settings", {}), " ") for p in front]


def plot(results: dict[str, dict], share: float, target: tuple[float, float], out: Path) -> list[dict]:
    found = points(results, share)
    if not found:
        raise SystemExit(f"no conversion at share {share:g} in {', '.join(results)}")
    front = frontier(found)
    plt = pyplot()
    fig, (axis, listing) = plt.subplots(2, 1, figsize=(12, 9), gridspec_kw={"height_ratios": [3, 1]})
    for marker, name in zip(itertools.cycle("osD^v<>pPX*h"), results):
        mine = [p for p in found if p["report"] == name]
        axis.plot([p["sparsity"] for p in mine], [p["cost"] for p in mine], marker, linestyle="none", alpha=0.6,
                  label=name)
    axis.plot([p["sparsity"] for p in front], [p["cost"] for p in front], "-", color="black", linewidth=1,
              label="frontier")
    for number, p in enumerate(front, 1):  # numbered: the settings are listed below the plot
        axis.annotate(str(number), (p["sparsity"], p["cost"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    sparsity, cost = target
    axis.fill_between([sparsity, max(p["sparsity"] for p in found) + 0.05], 0, cost, color="green", alpha=0.1,
                      label=f"target: >= {sparsity:g}% sparse at <= +{cost:g}%")
    axis.set(xlabel="held-out FFN sparsity (%)", ylabel="held-out CE vs original (%)",
             title=f"conversions on {share:g} of their base's pretraining tokens")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    listed = "\n".join(textwrap.fill(f"{number}: {p['sparsity']:.2f}%, {p['cost']:+.2f}%: {text} ({p['report']})", 140,
                                      subsequent_indent="   ")
                       for number, (p, text) in enumerate(zip(front, labels(front)), 1))
    listing.axis("off")
    listing.text(0, 1, "frontier:\n" + listed, fontsize=7, va="top", family="monospace", transform=listing.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return front


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--share", type=float, required=True, help="the budget: conversion tokens / pretraining tokens")
    ap.add_argument("--sparsity", type=float, default=99.0, help="the target's least sparsity (%%)")
    ap.add_argument("--cost", type=float, default=3.0, help="the target's largest held-out CE cost (%%)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    results = {path.stem: json.loads(path.read_text()) for path in args.reports}
    front = plot(results, args.share, (args.sparsity, args.cost), args.out)
    print("frontier: FFN sparsity | CE vs original | settings | report")
    for p, text in zip(front, labels(front)):
        print(f"{p['sparsity']:.2f}% | {p['cost']:+.2f}% | {text} | {p['report']}")
    return front


if __name__ == "__main__":
    main()
