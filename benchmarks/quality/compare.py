"""Budget curves of several bases on one figure, from their quality reports (convert_quality.py's JSONs): for one
conversion setting, each base's held-out cross-entropy cost against its own original at the end of each run, over
the conversion tokens (left) and over the share of that base's pretraining tokens (right). Each base is labelled
with its size, depth and pretraining tokens a parameter; each point is filled where the run ended at least 99%
sparse and hollow where it did not; reports of the same base (the same size, depth and pretraining tokens, each run
again) make one curve. Whether a conversion needs a share of the base's pretraining or a count of
tokens shows as which panel's curves fall on each other. The same figures are printed as a table.
A run of several passes over its text (--convert-epochs) is a setting of its own ('l1 3.5 epochs 2'), and its
conversion tokens are its distinct tokens, the budget its user lacks (it trained on that many times as many).

    python benchmarks/quality/compare.py benchmarks/results/quality_budget_d1024_h200.json BASE3X.json \\
        --out benchmarks/results/quality_budget_bases.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from plots import label_sparsity, pyplot
from runs import SPARSE, run_label


def base_label(result: dict) -> str:
    p = result["pretraining"]
    layers = p.get("config", {}).get("num_hidden_layers")
    depth = f", {layers} layers" if layers else ""
    return f"{p['parameters'] / 1e6:.0f}M{depth}, {p['tokens'] / p['parameters']:.2f} tokens/param"


def curve(result: dict, setting: str) -> list[dict]:
    """The report's conversions with run_label `setting`, by tokens: distinct tokens (those trained on in reports
    without them), share of pretraining, CE cost (%), sparsity."""
    pretraining_tokens = result["pretraining"]["tokens"]
    distinct = [c.get("distinct_tokens", c["tokens"]) for c in result["conversions"]]
    points = [{"tokens": tokens, "share": tokens / pretraining_tokens,
               "cost": 100 * c["ce_vs_original"], "sparsity": c["sparsity"]}
              for c, tokens in zip(result["conversions"], distinct) if run_label(c) == setting]
    return sorted(points, key=lambda p: p["tokens"])


def common_setting(results: dict[str, dict], setting: str | None) -> str:
    labels = [{run_label(c) for c in r["conversions"]} for r in results.values()]
    shared = set.intersection(*labels)
    if setting is not None:
        missing = [name for name, have in zip(results, labels) if setting not in have]
        if missing:
            raise SystemExit(f"--setting {setting!r}: not among the conversions of {', '.join(missing)}")
        return setting
    if len(shared) != 1:
        raise SystemExit(f"choose the conversion setting to compare with --setting: the reports share "
                         f"{sorted(shared) or 'none'}")
    return shared.pop()


def table(results: dict[str, dict], setting: str) -> str:
    lines = [f"setting: {setting}",
             "base | conversion tokens (distinct) | share of pretraining | FFN sparsity | CE vs original"]
    for name, result in results.items():
        for p in curve(result, setting):
            lines.append(f"{base_label(result)} ({name}) | {p['tokens'] / 1e6:.2f}M | {p['share']:.3g} | "
                         f"{100 * p['sparsity']:.2f}% | {p['cost']:+.2f}%")
    return "\n".join(lines)


def base_curves(results: dict[str, dict], setting: str) -> dict[str, list[dict]]:
    """Each base's curve (its base_label: its points by tokens), the points of its reports together."""
    bases: dict[str, list[dict]] = {}
    for result in results.values():
        bases.setdefault(base_label(result), []).extend(curve(result, setting))
    return {label: sorted(points, key=lambda p: p["tokens"]) for label, points in bases.items()}


def compare_plot(results: dict[str, dict], setting: str, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for label, points in base_curves(results, setting).items():
        for axis, x in zip(axes, ("tokens", "share")):
            line, = axis.plot([p[x] for p in points], [p["cost"] for p in points], "-", label=label)
            for p in points:
                axis.plot(p[x], p["cost"], "o", color=line.get_color(),
                          fillstyle="full" if p["sparsity"] >= SPARSE else "none")
                label_sparsity(axis, p[x], p["cost"], p["sparsity"])
    for axis, xlabel in zip(axes, ("distinct conversion tokens",
                                   "distinct conversion tokens / the base's pretraining tokens")):
        axis.axhline(0, color="black", linestyle="--", linewidth=1)
        axis.axhline(3, color="gray", linestyle=":", linewidth=1)
        axis.set(xscale="log", xlabel=xlabel)
    # the shares measured as the ticks: matplotlib's log minor ticks run into each other within one decade
    shares = sorted({p["share"] for result in results.values() for p in curve(result, setting)})
    axes[1].set_xticks(shares, [f"{100 * s:.3g}%" for s in shares], fontsize=7)
    axes[1].minorticks_off()
    axes[0].set_ylabel("held-out CE vs original (%)")
    axes[0].legend(fontsize=7, title=f"{setting}; filled: >= {100 * SPARSE:g}% sparse", title_fontsize=7)
    fig.suptitle("Conversion cost by budget, per base (end of each run; FFN sparsity beside each point)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", type=Path, nargs="+",
                    help="convert_quality.py JSON reports (several of one base make one curve)")
    ap.add_argument("--setting", help="the conversion setting to compare, as the reports label it (e.g. 'l1 3.5', or "
                                      "'l1 3.5 epochs 2' for its runs of 2 passes over their text, placed at their "
                                      "distinct tokens); needed where the reports share several")
    ap.add_argument("--out", type=Path, required=True, help="the figure (PNG)")
    args = ap.parse_args(argv)
    results = {path.name: json.loads(path.read_text()) for path in args.reports}
    setting = common_setting(results, args.setting)
    print(table(results, setting))
    compare_plot(results, setting, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
