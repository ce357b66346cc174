"""Conversion quality at real width: pretrain a SiLU Llama, convert it with `sparsify convert`, compare.

The chain, each stage's output in --work (a stage whose output is there is not redone, so the same command run
again after an interruption goes on where it stopped):
1. corpus (corpus.py): the Python sources and documentation installed on the machine that runs this (the standard
   library and site-packages; --toy: the standard library alone: .py, .pyi, .rst, .md, .txt files of 0.5-200 KB,
   deduplicated by content), read in the order of a hash of their path up to --corpus-mb, split by that hash into
   train and held-out (valid.jsonl: never trained on, by pretraining or conversion); each document's kind (code:
   .py, .pyi; prose: .rst, .md, .txt) recorded;
2. tokenizer and pretraining (pretrain.py): byte-level BPE (--vocab) trained on the first --tokenizer-mb of the
   train split; a SiLU Llama (--hidden, --intermediate, --layers) from scratch for --pretrain-steps or
   --pretrain-minutes (recipes/make_demo.py's loop: the train split read in epochs of shuffled windows; the epochs
   it took are in pretrain.json), best held-out loss kept. Its state is saved every --pretrain-save-every steps
   and the same command resumes it; --pretrain-stop-after N stops this invocation after N steps (exit status 75)
   on machines whose commands are time-limited;
3. convert (runs.py): each --runs setting (training settings over the recipe; by default the grid of --l1,
   relative: the L1 term's weight in nats at the start, and --distill, the weight of the KL term to the source
   model's next-token distributions) at each --convert-share (conversion tokens / pretraining tokens; several
   give the budget curve) through the real CLI, `python -m cli convert BASE -o OUT --data CORPUS --recipe ...`
   in a subprocess (--jobs at a time, over the machine's GPUs); on a GPU its layers move to the hybrid TwELL
   kernels as they become sparse.
   The CLI measures the held-out perplexity of the original, of the ReLU swap and of the converted model on the
   same held-out blocks, and per-layer sparsity and dead units; from its training log, the step and tokens at
   which it first reached 99% sparsity. At each --convert-epochs N above 1 (the few distinct tokens of a published
   model's user, read for more steps) a run reads only the head of the train split that holds the share's tokens
   (corpus.make_subset: its first documents, the last cut, so that it packs into the blocks a one-pass run reads
   first; written once per share to corpus_shareS) N times: --tokens N x those. Each pass packs the same blocks;
   the shuffle buffer and its random order run on through the passes, so that each pass comes in another order
   and a buffer's worth of blocks at each pass's end mixes with the next one's. With --sample-tokens N the base
   continues prompts from that head (`sparsify sample`: N tokens, its documents spread among the samples; written
   once per share to sampled_shareS, and the samples alone to sampled_shareS_alone), and the runs set data=sampled
   (or data=sampled_alone) read that folder instead, --sampled-epochs times (once unless set);
4. control (--control): at each share and number of passes, and on each sampled folder that runs read, the source
   model trained by the same trainer on the same batches with the same recipe (--control-set over it), but no swap,
   no L1 and no distillation, so that the cost of sparsity is told apart from the gain of the extra tokens (each
   conversion's ce_vs_control is against the control on its own text); the trained model is kept for the next
   stage;
5. metrics (metrics.py; --no-metrics skips it): the original, each control and each converted checkpoint loaded as
   plain dense models (no remote code), bf16 on a GPU, on the same held-out blocks: next-token cross-entropy and
   top-1 accuracy, per kind of document and over both, and greedy agreement with the original (64 held-out
   prompts of 32 tokens, 32 greedy tokens each: the share of tokens equal to the original's at the same position
   and the mean common prefix);
6. report (plots.py): one JSON (device, versions, corpus, pretraining, the original's metrics, the controls, every
   conversion with its log, share, `epochs` and `distinct_tokens`; with several shares `convert_tokens` is a list
   in the order of --convert-share and run names end in _shareS, with several passes they end in _epochsN; with
   several shares or --convert-epochs `control` is a list) and PNG plots beside it: cross-entropy and active units
   against training tokens, the sparsity / cross-entropy trade-off, and with several shares or --convert-epochs the
   budget curve (JSON_budget.png: held-out CE against the original over the share, a line per setting and number
   of passes, sparsity beside each point; with several --convert-epochs a second panel over the passes).

    python benchmarks/quality/convert_quality.py --work runs/quality --json benchmarks/results/quality_h100.json \\
        --control --runs l1=3.5 l1=3.5,swap_steps=150 --jobs 2
    python benchmarks/quality/convert_quality.py --work runs/budget --json budget.json --convert-share 0.25 0.1 0.05 \\
        --control --control-set lr=5e-5 --runs l1=3.5 --jobs 4     # the budget curve
    python benchmarks/quality/convert_quality.py --work runs/budget --json epochs.json --convert-share 0.05 \\
        --convert-epochs 1 2 4 --control --control-set lr=5e-5 --runs l1=3.5 --jobs 6     # few tokens, several passes
    python benchmarks/quality/convert_quality.py --toy --work /tmp/q   # CPU, tiny, stdlib only (tests)
"""
from __future__ import annotations

import argparse
import gc
import json
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import corpus
import metrics
import plots
import pretrain
import runs

TOY = dict(corpus_mb=0.4, tokenizer_mb=0.4, vocab=512, hidden=32, intermediate=88, layers=2, heads=2, seq_len=64,
           pretrain_batch=8, pretrain_minutes=10, pretrain_steps=20, eval_every=10, convert_batch=4,
           convert_share=[0.25], valid_share=0.1, l1=[7.0], distill=[0.0, 0.5], device="cpu", control=True,
           metrics_tokens=2048,
           recipe_overrides=[("log_every", 2), ("eval_tokens", 512), ("warmup_steps", 2), ("l1_warmup_steps", 2)])
MAX_SHARE = 0.25  # conversion gets at most a quarter of the pretraining tokens
# a run's data= setting: the keys of make_samples()'s record naming its folder and the tokens packed from it
SAMPLED_FOLDERS = {"sampled": ("folder", "tokens"), "sampled_alone": ("alone", "alone_tokens")}


def stage(path: Path, make, output: Path | None = None):
    """The JSON of a finished stage (whose `output`, where given, is there too), or make() it now and record it."""
    if path.is_file() and (output is None or output.exists()):
        return json.loads(path.read_text())
    value = make()
    tmp = path.with_name(path.name + ".tmp")  # renamed into place: a killed run leaves no half-written stage
    tmp.write_text(json.dumps(value, indent=1))
    tmp.rename(path)
    return value


def passes(text: str) -> int:
    """A --convert-epochs value: a whole number of passes, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"passes over the text must be a whole number, at least 1: got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="folder for corpus, models and stage results")
    ap.add_argument("--json", type=Path, help="write the report here (and the plots beside it, .png)")
    ap.add_argument("--toy", action="store_true",
                    help="tiny sizes on the CPU (end-to-end check, seconds); options given override them")
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
    ap.add_argument("--pretrain-save-every", type=int, default=500, metavar="N",
                    help="save the pretraining's state into --work every N steps (0: never); the same command "
                         "resumes from it")
    ap.add_argument("--pretrain-stop-after", type=int, metavar="N",
                    help="stop the pretraining after N steps of this invocation, its state saved, and exit with "
                         f"status {pretrain.PAUSED}; the same command resumes it (for time-limited machines)")
    ap.add_argument("--recipe", default="pretrained", help="conversion recipe (a name in recipes/ or a YAML)")
    ap.add_argument("--l1", type=float, nargs="+", default=[3.5, 7.0, 14.0], help="relative L1 coefficients")
    ap.add_argument("--distill", type=float, nargs="+", default=[0.0],
                    help="distillation weights (convert --distill), each run at every --l1")
    ap.add_argument("--runs", type=runs.parse_settings, nargs="+", metavar="KEY=VALUE,...",
                    help="conversions, each a comma-separated list of training settings over the recipe and --set, "
                         "e.g. l1=3.5 l1=3.5,swap_steps=150 (default: the grid of --l1 and --distill)")
    ap.add_argument("--control", action="store_true",
                    help="also train the source on the same tokens without swap, L1 or distillation (at each share)")
    ap.add_argument("--control-set", dest="control_overrides", type=runs.parse_setting, nargs="+", default=[],
                    metavar="KEY=VALUE", help="the control's settings over the recipe's, e.g. an lr that does not "
                                              "degrade the source: --control-set lr=1e-4 batch_size=4")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time: the conversions, each on the least busy of the machine's GPUs, and "
                         "with --control the controls (one after another, in this process) as one of them")
    ap.add_argument("--convert-share", type=float, nargs="+", default=[0.2], metavar="SHARE",
                    help=f"conversion tokens / pretraining tokens, at most {MAX_SHARE}; several (e.g. 0.25 0.1 0.05 "
                         "0.02): every run and the control at each, and the budget curve")
    ap.add_argument("--convert-epochs", type=passes, nargs="+", default=[1], metavar="N",
                    help="passes over the conversion's text: at N above 1 every run and the control read only the "
                         "first SHARE x pretraining tokens of the train split (its first documents, the last cut; "
                         "written once a share to WORK/corpus_shareS), N times; several (e.g. 1 2 4): each at every "
                         "share")
    ap.add_argument("--sample-tokens", type=int, default=0, metavar="N",
                    help="tokens sampled from the base for the runs set data=sampled (`sparsify sample`: prompts from "
                         "each share's head of the train split, its documents spread among the samples; written once "
                         "a share to WORK/sampled_shareS) or data=sampled_alone (the samples without the share's "
                         "documents: WORK/sampled_shareS_alone); those runs read their folder --sampled-epochs "
                         "times")
    ap.add_argument("--sampled-epochs", type=passes, default=1, metavar="N",
                    help="passes of the runs set data=... over their sampled folder, and of its control")
    ap.add_argument("--sample-batch", type=int, default=None,
                    help="samples generated together (default: as for sparsify sample, what fits)")
    ap.add_argument("--convert-batch", type=int, default=16, help="sequences a step (a run's batch_size overrides it)")
    ap.add_argument("--no-measure", dest="measure", action="store_false",
                    help="plan the kernels from the cost model instead of timing layers on the GPU (the quality "
                         "figures do not depend on the plan)")
    ap.add_argument("--no-metrics", dest="metrics", action="store_false",
                    help="skip the held-out metrics stage (accuracy, CE by kind, greedy agreement)")
    ap.add_argument("--metrics-tokens", type=int, default=262_144,
                    help="held-out tokens of each kind (code, prose) the metrics read, at most")
    ap.add_argument("--set", dest="recipe_overrides", type=runs.parse_setting, nargs="+", default=[],
                    metavar="KEY=VALUE",
                    help="override recipe settings, e.g. --set lr=3e-4 l1_warmup_steps=50")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def arguments(argv=None) -> argparse.Namespace:
    """The parsed command line, --toy's sizes as its defaults, checked."""
    ap = parser()
    if ap.parse_args(argv).toy:
        ap.set_defaults(**TOY)
    args = ap.parse_args(argv)
    if not all(0 < share <= MAX_SHARE for share in args.convert_share):
        ap.error(f"--convert-share must be in (0, {MAX_SHARE}]: conversion gets at most a quarter of the pretraining "
                 "tokens")
    if len(set(args.convert_share)) < len(args.convert_share):
        ap.error("--convert-share: each share once")
    if len(set(args.convert_epochs)) < len(args.convert_epochs):
        ap.error("--convert-epochs: each number of passes once")
    sampled = [run for run in args.runs or [] if "data" in run]
    if any(run["data"] not in SAMPLED_FOLDERS for run in sampled) or sampled and args.sample_tokens < 1:
        ap.error("a run's data= takes sampled (the share's text and the samples) or sampled_alone, with "
                 "--sample-tokens N")
    if args.pretrain_stop_after is not None and args.pretrain_stop_after < 1 or args.pretrain_save_every < 0:
        ap.error("--pretrain-stop-after must be at least 1 and --pretrain-save-every at least 0")
    if args.metrics and args.seq_len < metrics.PROMPT_TOKENS + metrics.NEW_TOKENS:
        ap.error(f"--seq-len must be at least {metrics.PROMPT_TOKENS + metrics.NEW_TOKENS} for the greedy agreement "
                 "(prompts and continuations), or pass --no-metrics")
    from sparsify.config import TrainConfig  # no torch
    from sparsify.recipe import load_recipe
    from sparsify.errors import ConfigError

    try:  # a mistyped or impossible setting stops the pipeline here, not in a conversion after the pretraining
        args.recipe_settings = {**load_recipe(args.recipe, "base"), **dict(args.recipe_overrides)}
        for option, settings in [*(("--runs", run) for run in args.runs or []),
                                 ("--control-set", dict(args.control_overrides))]:
            training = {k: v for k, v in settings.items() if k not in runs.PIPELINE_SETTINGS}
            try:
                TrainConfig.from_dict({**args.recipe_settings, **training}).validate()
            except ConfigError as error:
                raise ConfigError(f"{option} {','.join(f'{k}={v}' for k, v in settings.items())}: {error}") from None
    except ConfigError as error:
        ap.error(str(error))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def prepare(args) -> tuple[dict, dict]:
    """The corpus and pretraining stages: their figures (PretrainingPaused where --pretrain-stop-after stopped it)."""
    args.work.mkdir(parents=True, exist_ok=True)
    corpus_dir = args.work / "corpus"
    made = stage(args.work / "corpus.json",
                 lambda: corpus.make_corpus(corpus_dir, args.corpus_mb, args.valid_share, packages=not args.toy))
    print(f"corpus: {made['files']} files, {made['bytes']} bytes", flush=True)
    if args.metrics:  # a corpus made without document kinds fails now, not after the training
        corpus.read_documents(corpus_dir / "valid.jsonl")
    return made, stage(args.work / "pretrain.json", lambda: pretrain.pretrain_base(args, args.work, corpus_dir))


def make_subsets(args, recipe: dict, tokens: dict[float, int]) -> dict[float, dict]:
    """Where --convert-epochs asks for more than one pass or --sample-tokens for samples: each share's head of the
    train split (corpus.make_subset, WORK/corpus_shareS, a stage of its own), its figures and "folder"."""
    if max(args.convert_epochs) == 1 and not args.sample_tokens:
        return {}
    from transformers import AutoTokenizer

    from sparsify.config import TrainConfig

    tok = AutoTokenizer.from_pretrained(args.work / "base")
    shuffled = recipe.get("shuffle_buffer", TrainConfig.shuffle_buffer)
    made = {}
    for share, count in tokens.items():
        folder = args.work / f"corpus_share{share:g}"
        made[share] = {"share": share, "folder": folder.name, **stage(folder.with_name(folder.name + ".json"), (
            lambda: corpus.make_subset(args.work / "corpus", folder, tok, args.seq_len, count)), output=folder)}
        print(f"{folder.name}: {made[share]['documents']} documents, {made[share]['distinct_tokens']:,} tokens a pass "
              f"({made[share]['blocks']} blocks)", flush=True)
        if shuffled >= made[share]["blocks"]:
            print(f"note: the shuffle buffer ({shuffled} blocks) holds a pass or more: the passes mix (--set "
                  "shuffle_buffer=N below the blocks a pass keeps them apart)", flush=True)
    return made


def make_samples(args, recipe: dict, subsets: dict[float, dict]) -> dict[float, dict]:
    """With --sample-tokens: each share's data folder of text sampled from the base (sparsify.sample, prompts and
    documents from the share's head; WORK/sampled_shareS, a stage of its own) and beside it the samples alone (its
    rows that are samples, the same held-out text: WORK/sampled_shareS_alone); its record with "folder" and
    "alone", and for each the tokens the conversion's reader packs from its training text ("tokens",
    "alone_tokens")."""
    if not args.sample_tokens:
        return {}
    import torch
    from transformers import AutoTokenizer

    from sparsify.config import SampleOptions, TrainConfig
    from sparsify.data import TextData
    from sparsify.sample import sample

    def made(folder: Path, head: Path) -> dict:
        record = sample(str(args.work / "base"), SampleOptions(
            out=folder, tokens=args.sample_tokens, data=str(head), seq_len=args.seq_len, batch_size=args.sample_batch,
            with_data=True, eval_tokens=recipe.get("eval_tokens", TrainConfig.eval_tokens), seed=args.seed,
            device=args.device, overwrite=True))  # the runs' held-out text whole
        gc.collect()  # the conversions run in processes of their own on the same GPU: free what sampling held
        torch.cuda.empty_cache()
        alone = folder.with_name(folder.name + "_alone")
        shutil.rmtree(alone, ignore_errors=True)
        alone.mkdir()
        shutil.copy(folder / "valid.jsonl", alone / "valid.jsonl")
        with open(folder / "train.jsonl") as rows, open(alone / "train.jsonl", "w") as kept:
            kept.writelines(row for row in rows if json.loads(row)["source"] == "sample")
        tok = AutoTokenizer.from_pretrained(args.work / "base")
        packed = [sum(1 for _ in TextData(f, tok, args.seq_len, args.seq_len).training_blocks()) * args.seq_len
                  for f in (folder, alone)]
        return {**record, "alone": alone.name, "tokens": packed[0], "alone_tokens": packed[1]}

    samples = {}
    for share, subset in subsets.items():
        folder = args.work / f"sampled_share{share:g}"
        samples[share] = {"share": share, "folder": folder.name, **stage(
            folder.with_name(folder.name + ".json"), lambda: made(folder, args.work / subset["folder"]), output=folder)}
        print(f"{folder.name}: {samples[share]['sampled_tokens']:,} tokens sampled and "
              f"{samples[share]['data_tokens']:,} of the share's text "
              f"({samples[share]['tokens']:,} packed)", flush=True)
    return samples


def train_all(args, recipe: dict, tokens: dict[float, int], subsets: dict[float, dict], samples: dict[float, dict]
              ) -> tuple[list[dict], list[dict]]:
    """Every conversion at every share and number of passes, and the control at each with --control; each entry
    with its share, epochs and distinct tokens. At one pass a run reads the corpus's train split from its start
    for the share's tokens; at N passes the share's head of it (`subsets`, from make_subsets()) N times. The controls
    train one after another in this process, the conversions in their own (--jobs at a time)."""
    several = len(tokens) > 1
    settings = args.runs or [{"l1": l1, "distill": distill} for l1 in args.l1 for distill in args.distill]
    base = args.work / "base"
    budgets = [(share, epochs) for share in tokens for epochs in args.convert_epochs]

    def data(share: float, epochs: int, setting: dict | None = None) -> tuple[Path, int, int | None]:
        """A run's train text, its tokens, and at several passes the distinct tokens they pass over."""
        if (setting or {}).get("data"):
            folder, count = SAMPLED_FOLDERS[setting["data"]]
            return args.work / samples[share][folder], epochs * samples[share][count], samples[share][count]
        if epochs == 1:
            return args.work / "corpus", tokens[share], None
        distinct = subsets[share]["distinct_tokens"]
        return args.work / subsets[share]["folder"], epochs * distinct, distinct

    def entry(name: str, share: float, epochs: int, distinct: int | None, made: dict) -> dict:
        # one pass: every token trained on is read once
        return {"name": name, "share": share, "epochs": epochs,
                "distinct_tokens": made["tokens"] if distinct is None else distinct, **made}

    def conversion(setting: dict, share: float, epochs: int) -> dict:
        name = runs.run_name(setting, share if several else None, epochs)
        text, count, distinct = data(share, epochs, setting)
        c = entry(name, share, epochs, distinct, stage(args.work / f"convert_{name}.json", lambda: runs.convert(
            args, base, text, recipe, args.work / name, setting, count)))
        print(runs.summary_line(c), flush=True)
        return c

    def control(share: float, epochs: int, folder: str | None = None) -> dict:
        """The control on the runs' text at (share, epochs): the share's, or a sampled folder's (data=folder)."""
        setting = {"data": folder} if folder else {}
        out = args.work / (runs.control_name(share if several else None, epochs) + (f"_{folder}" if folder else ""))
        text, count, distinct = data(share, epochs, setting)
        return {**entry(out.name, share, epochs, distinct, stage(
            out.with_name(out.name + ".json"), lambda: runs.control(args, base, text, recipe, count, out),
            output=out if args.metrics else None)), "settings": setting}

    sampled = sorted({setting["data"] for setting in settings if "data" in setting})
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        continued = pool.submit(lambda: [control(*b) for b in budgets] + [control(
            share, args.sampled_epochs, folder) for share in tokens for folder in sampled]) if args.control else None
        pending = [pool.submit(conversion, setting, share, args.sampled_epochs if "data" in setting else epochs)
                   for share, epochs in budgets for setting in settings  # a sampled folder's runs once a share
                   if "data" not in setting or epochs == args.convert_epochs[0]]
        controls = continued.result() if continued else []
        conversions = [job.result() for job in pending]
    for c in conversions:  # against the control on the same text and passes
        for reference in controls:
            if (reference["share"], reference["epochs"], reference["settings"].get("data")) == (
                    c["share"], c["epochs"], c["settings"].get("data")):
                c["ce_vs_control"] = (c["cross_entropy"]["after training"]
                                      / reference["cross_entropy"]["after training"] - 1)
    return conversions, controls


def measure_all(args, conversions: list[dict], controls: list[dict]) -> dict:
    """The metrics stage: adds "metrics" to every conversion and control; returns the original's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.work / "base")
    blocks = metrics.heldout_blocks(tok, args.work / "corpus", args.seq_len, args.metrics_tokens)
    prompts = metrics.greedy_prompts(blocks)

    def measured(name: str, reference) -> dict:
        return stage(args.work / f"metrics_{name}.json", lambda: metrics.measure(
            args.work / name, blocks, prompts, reference, args.convert_batch, args.device))

    original = measured("base", None)
    if original["prompts"] != prompts.tolist():
        raise SystemExit(f"{args.work}/metrics_base.json: the original was measured on other held-out prompts (another "
                         f"--seq-len or --metrics-tokens?); remove {args.work}/metrics_*.json "
                         "to measure every model again")
    for c in (*controls, *conversions):
        c["metrics"] = measured(c["name"], original["generations"])
    return {k: v for k, v in original.items() if k not in ("prompts", "generations")}


def print_summary(result: dict) -> None:
    if result.get("original"):
        print("original:", metrics.metrics_line(result["original"]["metrics"]))
    for c in plots.controls(result):
        ce = c["cross_entropy"]
        print(f"{c['name']}: held-out CE {ce['original']:.4f} -> "
              f"{ce['after training']:.4f}" + (f"  {metrics.metrics_line(c['metrics'])}" if "metrics" in c else ""))
    for c in result["conversions"]:
        print(runs.summary_line(c))
        if "metrics" in c:
            print("    " + metrics.metrics_line(c["metrics"]))


def main(argv=None) -> dict:
    args = arguments(argv)
    import torch
    from sparsify.bench import versions

    started = time.time()
    try:
        made, pretraining = prepare(args)
    except pretrain.PretrainingPaused as paused:
        print(paused, flush=True)
        raise SystemExit(pretrain.PAUSED)
    tokens = {share: int(share * pretraining["tokens"]) for share in args.convert_share}
    recipe = args.recipe_settings
    subsets = make_subsets(args, recipe, tokens)
    samples = make_samples(args, recipe, subsets)
    conversions, controls = train_all(args, recipe, tokens, subsets, samples)
    for c in conversions:
        c["first_sparse"] = runs.first_sparse(c["log"], pretraining["config"]["intermediate_size"])
    original = measure_all(args, conversions, controls) if args.metrics else None
    several, budgets = len(tokens) > 1, len(tokens) * len(args.convert_epochs) > 1
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"command": shlex.join([Path(sys.argv[0]).name if argv is None else "convert_quality.py",
                                     *(sys.argv[1:] if argv is None else argv)]),
              "device": device, "versions": versions(), "seconds": round(time.time() - started, 1),
              "corpus": made, "pretraining": pretraining, "convert_shares": args.convert_share,
              "convert_tokens": list(tokens.values()) if several else tokens[args.convert_share[0]],
              "convert_epochs": args.convert_epochs, "convert_subsets": list(subsets.values()),
              "samples": list(samples.values()), "recipe": recipe,
              "original": original and {"model": "base", "metrics": original},
              "control": controls if budgets or len(controls) > 1 else (controls[0] if controls else None),
              "conversions": conversions}
    print_summary(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        plots.plot(result, args.json.with_suffix(".png"))
        if budgets:
            plots.budget_plot(result, args.json.with_name(args.json.stem + "_budget.png"))
    return result


if __name__ == "__main__":
    main()
