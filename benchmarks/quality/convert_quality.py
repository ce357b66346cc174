"""Conversion quality at real width: pretrain a SiLU Llama, convert it with `sparsify convert`, compare.

The chain, each stage in its own folder under --work (a stage whose output is there is not redone):
1. corpus: the Python sources and documentation installed on the machine that runs this (the standard
   library and site-packages; --toy: the standard library alone: .py, .pyi, .rst, .md, .txt files of
   0.5-200 KB, deduplicated by content),
   read in the order of a hash of their path up to --corpus-mb, split by that hash into train and
   held-out (valid.jsonl: never trained on, by pretraining or conversion);
2. tokenizer: byte-level BPE (--vocab) trained on the first --tokenizer-mb of the train split;
3. pretrain: a SiLU Llama (--hidden, --intermediate, --layers) from scratch for --pretrain-minutes
   (recipes/make_demo.py's pretraining loop), best held-out loss kept;
4. convert: each --runs setting (training settings over the recipe; by default the grid of --l1, relative:
   the L1 term's weight in nats at the start, and --distill, the weight of the KL term to the source model's
   next-token distributions) through the real CLI, `python -m cli convert BASE -o OUT --data CORPUS
   --recipe ...` in a subprocess (--jobs at a time), on at most --convert-share of the pretraining tokens;
   on a GPU its layers move to the hybrid TwELL kernels as they become sparse. The CLI measures the
   held-out perplexity of the original, of the ReLU swap and of the converted model on the same held-out
   blocks, and per-layer sparsity and dead units;
5. control (--control): the source model trained by the same trainer on the same batches with the same recipe,
   but no swap, no L1 and no distillation, so that the cost of sparsity is told apart from the gain of the
   extra tokens;
6. report: one JSON (device, versions, corpus, pretraining, the control, every conversion with its log) and
   PNG plots: cross-entropy and active units against training tokens, and the sparsity / cross-entropy
   trade-off.

    python benchmarks/quality/convert_quality.py --work runs/quality --json benchmarks/results/quality_h100.json \
        --control --runs l1=3.5 l1=3.5,swap_steps=150 --jobs 2
    python benchmarks/quality/convert_quality.py --toy --work /tmp/q   # CPU, tiny, stdlib only (tests)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import time
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from recipes import make_demo  # noqa: E402  (the demo's tokenizer and pretraining, at other sizes)

EXTENSIONS = (".py", ".pyi", ".rst", ".md", ".txt")
MIN_BYTES, MAX_BYTES = 500, 200_000
PACKAGE_FOLDERS = ("site-packages", "dist-packages")
TOY = dict(corpus_mb=0.4, tokenizer_mb=0.4, vocab=512, hidden=32, intermediate=88, layers=2, heads=2, seq_len=64,
           pretrain_batch=8, pretrain_minutes=10, pretrain_steps=20, eval_every=10, convert_batch=4,
           convert_share=0.25, valid_share=0.1, l1=[7.0], distill=[0.0, 0.5], device="cpu", control=True,
           recipe_overrides={"log_every": 2, "eval_tokens": 512, "warmup_steps": 2, "l1_warmup_steps": 2})


def source_files(packages: bool = True) -> list[tuple[str, Path]]:
    """(key, path) of every candidate file of the standard library (and with `packages`, site-packages);
    the key (the path below its folder) orders and splits the corpus, so that it does not depend on where
    Python is installed."""
    roots = {Path(sysconfig.get_paths()[k]) for k in (("stdlib", "purelib", "platlib") if packages else ("stdlib",))}
    found = {}
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in PACKAGE_FOLDERS]  # walked as roots of their own, or not at all
            for name in names:
                path = Path(folder, name)
                if path.suffix in EXTENSIONS:
                    found[f"{root.name}/{path.relative_to(root)}"] = path
    return sorted(found.items(), key=lambda item: hashlib.sha1(item[0].encode()).digest())


def held_out(key: str, share: float) -> bool:
    """Whether a file goes to the held-out split: a second hash, independent of the reading order's."""
    return hashlib.sha1(f"held-out:{key}".encode()).digest()[0] < 256 * share


def make_corpus(out: Path, megabytes: float, valid_share: float, packages: bool = True) -> dict:
    """train.jsonl and valid.jsonl (one {"text"} a file) of up to `megabytes` of distinct texts."""
    seen, sizes, counts = set(), {"train": 0, "valid": 0}, {"train": 0, "valid": 0}
    out.mkdir(parents=True, exist_ok=True)
    files = {split: open(out / f"{split}.jsonl.tmp", "w") for split in sizes}
    for key, path in source_files(packages):
        if sum(sizes.values()) >= megabytes * 1e6:
            break
        try:
            if not MIN_BYTES <= path.stat().st_size <= MAX_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if digest in seen:
            continue
        seen.add(digest)
        split = "valid" if held_out(key, valid_share) else "train"
        files[split].write(json.dumps({"text": text}) + "\n")
        sizes[split] += len(text.encode())
        counts[split] += 1
    for split, f in files.items():
        f.close()
        (out / f"{split}.jsonl.tmp").rename(out / f"{split}.jsonl")
    return {"source": f"Python {platform.python_version()} standard library{' and site-packages' * packages}: "
                      f"{', '.join(EXTENSIONS)} files of {MIN_BYTES}-{MAX_BYTES} bytes, distinct texts, in the order "
                      f"of a hash of their path", "files": counts, "bytes": sizes}


def read_texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in open(path)]


def pretrain(args, work: Path, corpus: Path) -> dict:
    from transformers import LlamaConfig

    texts, sample, size = read_texts(corpus / "train.jsonl"), [], 0
    for text in texts:  # the tokenizer's sample: the first --tokenizer-mb of the train split
        if size >= args.tokenizer_mb * 1e6:
            break
        sample.append(text)
        size += len(text)
    tok = make_demo.train_tokenizer(sample, args.vocab, work / "tokenizer", max_length=args.seq_len)
    train, valid = make_demo.token_ids(tok, texts), make_demo.token_ids(tok, read_texts(corpus / "valid.jsonl"))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq_len, hidden_act="silu",
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, rope_theta=10000.0)
    result = make_demo.pretrain_llama(
        config, tok, train, valid, work / "base", steps=args.pretrain_steps, minutes=args.pretrain_minutes,
        batch=args.pretrain_batch, seq_len=args.seq_len, lr=args.pretrain_lr, warmup=args.pretrain_warmup,
        eval_every=args.eval_every, device=args.device, seed=args.seed)
    result.update(train_tokens=len(train), valid_tokens=len(valid), vocab=len(tok),
                  config={k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "vocab_size")})
    return result


def convert(args, base: Path, corpus: Path, recipe: dict, out: Path, settings: dict, tokens: int) -> dict:
    """One conversion through the command line with `settings` over `recipe`; returns its figures read back
    from the checkpoint. With --jobs above 1 its output goes to OUT.log."""
    run_recipe = out.with_name(out.name + ".recipe.yaml")
    run_recipe.write_text(json.dumps({**recipe, **settings}, indent=1))  # JSON is YAML
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
    started = time.time()
    with open(out.with_name(out.name + ".log"), "w") if args.jobs > 1 else nullcontext() as output:
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=output, stderr=subprocess.STDOUT if output else None)
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
        "log": [{k: e[k] for k in ("step", "tokens", "cross_entropy", "kl", "l1", "mean_active", "dead_frac",
                                   "source_share", "tokens_per_s") if k in e}
                | {"hybrid_layers": sum(l["path"] == "hybrid" for l in e["layers"])} for e in log["log"]],
    }


def control(args, base: Path, corpus: Path, recipe: dict, tokens: int) -> dict:
    """The continued-training control: the source model trained by sparsify's trainer on the conversions'
    batches with their recipe, but no swap, no L1 and no distillation. Its MLPs are ReluGatedMLPs (for
    the trainer's statistics) holding the source activation throughout (source_share 1)."""
    import torch

    from sparsify.data import TextData
    from sparsify.load import load_model
    from sparsify.measure import perplexity
    from sparsify.relufy import relufy
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
    print(f"control (continued SiLU): held-out CE {math.log(before):.4f} -> {math.log(after):.4f}", flush=True)
    return {"tokens": result.tokens, "steps": result.steps, "training_seconds": round(result.seconds, 1),
            "cross_entropy": {"original": math.log(before), "after training": math.log(after)},
            "log": [{k: e[k] for k in ("step", "tokens", "cross_entropy", "tokens_per_s")} for e in result.log]}


def settings_text(settings: dict, sep: str, without: tuple = ()) -> str:
    """`settings` as "key{sep}value" pairs joined by sep (distill 0, the default, left out)."""
    return sep.join(f"{k}{sep}{v:g}" if isinstance(v, (int, float)) else f"{k}{sep}{v}" for k, v in settings.items()
                    if k not in without and not (k == "distill" and not v))


def run_name(settings: dict) -> str:
    return settings_text(settings, "_")


def run_label(run: dict, without: tuple = ()) -> str:
    settings = run.get("settings") or {"l1": run["l1_relative"], "distill": run.get("distill", 0.0)}
    return settings_text(settings, " ", without)


SMOOTHING = 0.1  # training curves are means over a trailing window of this share of the run's log entries


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


def plot(result: dict, path: Path) -> None:
    """Three panels: training cross-entropy (smoothed) with the held-out points (the original at the start, each
    converted model and the control at their end), active units per token (smoothed, the held-out measurement at
    the end), and the held-out sparsity / cross-entropy trade-off, its axes around the runs' points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["conversions"]
    units = result["pretraining"]["config"]["intermediate_size"]
    fig, (ce, active, trade) = plt.subplots(1, 3, figsize=(16, 4.5))
    original = runs[0]["cross_entropy"]["original"]
    for index, run in enumerate(runs):
        tokens = [e["tokens"] / 1e6 for e in run["log"]]
        line, = ce.plot(tokens, smoothed([e["cross_entropy"] for e in run["log"]]))  # runs named in the next panel
        ce.plot(tokens[-1], run["cross_entropy"]["after training"], "o", color=line.get_color(),
                label=None if index else "converted, held-out")
        active.plot(tokens, smoothed([e["mean_active"] for e in run["log"]]), label=run_label(run),
                    color=line.get_color())
        active.plot(tokens[-1], run["mean_active"], "o", color=line.get_color())
    if result.get("control"):
        log = result["control"]["log"]
        tokens = [e["tokens"] / 1e6 for e in log]
        ce.plot(tokens, smoothed([e["cross_entropy"] for e in log]), color="black", linewidth=1,
                label="control: continued SiLU")
        ce.plot(tokens[-1], result["control"]["cross_entropy"]["after training"], "s", color="black",
                label="control, held-out")
    ce.plot(0, original, "D", color="black", label="original, held-out")
    ce.axhline(original, color="black", linestyle="--", linewidth=1)
    ce.axhline(original * 1.03, color="gray", linestyle=":", linewidth=1, label="original + 3%")
    ce.set(xlabel="conversion tokens (M)", title="cross-entropy (nats)",
           ylabel=f"lines: training, mean of the last {SMOOTHING:.0%} of the logs")
    active.axhline(0.01 * units, color="gray", linestyle=":", linewidth=1, label="99% sparse")
    active.set(xlabel="conversion tokens (M)", ylabel=f"mean active units per token (of {units})", yscale="log",
               title="active units: training (lines), held-out (points)")
    for axis in (ce, active):
        axis.legend(fontsize=7)
    curves = {}  # one curve per setting other than the L1 weight
    for r in runs:
        curves.setdefault(run_label(r, without=("l1",)) or "l1 only", []).append(r)
    for label, curve in curves.items():
        curve.sort(key=lambda r: r["sparsity"])
        trade.plot([100 * r["sparsity"] for r in curve], [100 * r["ce_vs_original"] for r in curve], "o-",
                   label=label)
    trade.legend(fontsize=7)
    for r in runs:
        trade.annotate(f"l1 {r['l1_relative']:g}", (100 * r["sparsity"], 100 * r["ce_vs_original"]), fontsize=7,
                       xytext=(4, 4), textcoords="offset points")
    trade.axhline(3, color="gray", linestyle=":", linewidth=1)
    trade.axvline(99, color="gray", linestyle=":", linewidth=1)
    trade.set(xlabel="held-out FFN sparsity (%)", ylabel="held-out CE vs original (%)", title="trade-off",
              xlim=data_limits([100 * r["sparsity"] for r in runs], top=100),
              ylim=data_limits([100 * r["ce_vs_original"] for r in runs]))
    fig.suptitle(f"{result['pretraining']['parameters'] / 1e6:.0f}M-parameter SiLU Llama -> sparse ReLU "
                 f"({result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _setting(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value = yaml.safe_load(value)
    try:  # YAML 1.1 reads 8e-4 (no dot) as a string
        return key, float(value) if isinstance(value, str) else value
    except ValueError:
        return key, value


def _settings(text: str) -> dict:
    return dict(_setting(item) for item in text.split(","))


def stage(path: Path, make):
    """The JSON of a finished stage, or make() it now and record it."""
    if path.is_file():
        return json.loads(path.read_text())
    value = make()
    tmp = path.with_name(path.name + ".tmp")  # renamed into place: a killed run leaves no half-written stage
    tmp.write_text(json.dumps(value, indent=1))
    tmp.rename(path)
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="folder for corpus, models and stage results")
    ap.add_argument("--json", type=Path, help="write the report here (and the plot beside it, .png)")
    ap.add_argument("--toy", action="store_true", help="tiny sizes on the CPU (end-to-end check, seconds)")
    ap.add_argument("--corpus-mb", type=float, default=250.0)
    ap.add_argument("--valid-share", type=float, default=0.01, help="share of files held out")
    ap.add_argument("--tokenizer-mb", type=float, default=25.0)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--pretrain-batch", type=int, default=32)
    ap.add_argument("--pretrain-minutes", type=float, default=4.5)
    ap.add_argument("--pretrain-steps", type=int, default=100_000)
    ap.add_argument("--pretrain-lr", type=float, default=8e-4)
    ap.add_argument("--pretrain-warmup", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--recipe", default="pretrained", help="conversion recipe (a name in recipes/ or a YAML)")
    ap.add_argument("--l1", type=float, nargs="+", default=[3.5, 7.0, 14.0], help="relative L1 coefficients")
    ap.add_argument("--distill", type=float, nargs="+", default=[0.0],
                    help="distillation weights (convert --distill), each run at every --l1")
    ap.add_argument("--runs", type=_settings, nargs="+", metavar="KEY=VALUE,...",
                    help="conversions, each a comma-separated list of training settings over the recipe and --set, "
                         "e.g. l1=3.5 l1=3.5,swap_steps=150 (default: the grid of --l1 and --distill)")
    ap.add_argument("--control", action="store_true",
                    help="also train the source on the same tokens without swap, L1 or distillation")
    ap.add_argument("--control-set", dest="control_overrides", type=_setting, nargs="+", default=[],
                    metavar="KEY=VALUE", help="the control's settings over the recipe's, e.g. an lr that does not "
                                              "degrade the source: --control-set lr=1e-4 batch_size=4")
    ap.add_argument("--jobs", type=int, default=1, help="conversions run at a time (each on the same GPU)")
    ap.add_argument("--convert-share", type=float, default=0.2, help="conversion tokens / pretraining tokens")
    ap.add_argument("--convert-batch", type=int, default=16, help="sequences a step (a run's batch_size overrides it)")
    ap.add_argument("--no-measure", dest="measure", action="store_false",
                    help="plan the kernels from the cost model instead of timing layers on the GPU (the quality "
                         "figures do not depend on the plan)")
    ap.add_argument("--set", dest="recipe_overrides", type=_setting, nargs="+", default=[], metavar="KEY=VALUE",
                    help="override recipe settings, e.g. --set lr=3e-4 l1_warmup_steps=50")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    if args.toy:
        for key, value in TOY.items():
            setattr(args, key, list(value.items()) if key == "recipe_overrides" else value)
    if not 0 < args.convert_share <= 0.25:
        ap.error("--convert-share must be in (0, 0.25]: conversion gets at most a quarter of the pretraining tokens")
    args.work.mkdir(parents=True, exist_ok=True)
    import torch
    from sparsify.bench import versions

    started = time.time()
    corpus_dir = args.work / "corpus"
    corpus = stage(args.work / "corpus.json",
                   lambda: make_corpus(corpus_dir, args.corpus_mb, args.valid_share, packages=not args.toy))
    print(f"corpus: {corpus['files']} files, {corpus['bytes']} bytes", flush=True)
    pretraining = stage(args.work / "pretrain.json", lambda: pretrain(args, args.work, corpus_dir))
    tokens = int(args.convert_share * pretraining["tokens"])
    from sparsify.config import load_recipe

    recipe = {**load_recipe(args.recipe, "base"), **dict(args.recipe_overrides)}
    runs = args.runs or [{"l1": l1, "distill": distill} for l1 in args.l1 for distill in args.distill]

    def report(c: dict, reference: dict | None) -> None:
        vs_control = f", {100 * c['ce_vs_control']:+.2f}% vs control" if reference else ""
        print(f"{run_label(c)}: sparsity {100 * c['sparsity']:.2f}%  held-out CE {c['cross_entropy']['original']:.4f} -> "
              f"{c['cross_entropy']['after swap']:.4f} (swap) -> {c['cross_entropy']['after training']:.4f} "
              f"({100 * c['ce_vs_original']:+.2f}%{vs_control})", flush=True)

    def run(settings: dict) -> dict:
        name = run_name(settings)
        c = stage(args.work / f"convert_{name}.json", lambda: convert(
            args, args.work / "base", corpus_dir, recipe, args.work / name, settings, tokens))
        report(c, None)
        return c

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # the control trains in this process, conversions in theirs
        reference = pool.submit(stage, args.work / "control.json", lambda: control(
            args, args.work / "base", corpus_dir, recipe, tokens)) if args.control else None
        pending = [pool.submit(run, settings) for settings in runs]
        continued = reference.result() if reference else None
        conversions = [job.result() for job in pending]
    for c in conversions if continued else ():
        c["ce_vs_control"] = c["cross_entropy"]["after training"] / continued["cross_entropy"]["after training"] - 1
        report(c, continued)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    result = {"command": shlex.join([Path(sys.argv[0]).name if argv is None else "convert_quality.py",
                                     *(sys.argv[1:] if argv is None else argv)]),
              "device": device, "versions": versions(), "seconds": round(time.time() - started, 1),
              "corpus": corpus, "pretraining": pretraining, "convert_tokens": tokens, "recipe": recipe,
              "control": continued, "conversions": conversions}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.json.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
