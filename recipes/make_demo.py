"""Remake the embedded demo: sparsify/demo/corpus (text) and sparsify/demo/model (a small SiLU Llama).

No machine of ours reaches the Hugging Face Hub, so the demo is built from material every Python
install has: the standard library's own documentation, rendered by pydoc from the imported modules
(module, class and function docstrings with signatures) plus the language reference topics that pydoc
ships (pydoc_data.topics). Three stages, each writing into sparsify/demo/:

    python recipes/make_demo.py corpus      # corpus/train.jsonl, corpus/valid.jsonl (by document, 95/5)
    python recipes/make_demo.py tokenizer   # byte-level BPE, vocab 4096, saved into model/
    python recipes/make_demo.py pretrain --device cuda   # model/ weights: 1200 steps (best kept)
    python recipes/make_demo.py all --device cuda        # the three in order

Pretraining also runs on CPU, slowly: `pretrain --device cpu --minutes 60`.
The corpus depends on the Python version (corpus/README.md records it); seeds are fixed. Pretraining
reads the train split in epochs of shuffled windows, ends at --steps or after --minutes, whichever comes
first (the cosine schedule follows whichever is nearer), and keeps the weights with the best validation loss.
"""
import argparse, contextlib, hashlib, importlib, io, json, math, os, pkgutil, re, sys, sysconfig, time, warnings
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "sparsify" / "demo"
CORPUS, MODEL = DEMO / "corpus", DEMO / "model"
# Modules with side effects on import (browser, printing, GUI, package installs) or that are tests/tools.
SKIP = {"antigravity", "this", "tkinter", "idlelib", "turtle", "turtledemo", "test", "tests", "lib2to3",
        "ensurepip", "venv", "pydoc_data", "__main__", "site", "xxsubtype", "xxlimited", "xxlimited_35"}


def module_names():
    """Public stdlib module names (built-in and on disk, packages walked), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    names = {n for n in sys.builtin_module_names}
    for info in pkgutil.iter_modules([root, os.path.join(root, "lib-dynload")]):
        names.add(info.name.split(".")[0])
    keep = lambda n: not any(p.startswith("_") or p in SKIP or p.startswith("test") for p in n.split("."))
    names = {n for n in names if keep(n)}
    for pkg in sorted(names):
        try:
            mod = safe_import(pkg)
        except Exception:
            continue
        if hasattr(mod, "__path__"):
            for info in pkgutil.walk_packages(mod.__path__, pkg + ".", onerror=lambda n: None):
                if keep(info.name):
                    names.add(info.name)
    return sorted(names)


def safe_import(name):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def clean(text):
    text = re.sub(r" at 0x[0-9a-f]+|(?<=handle) [0-9a-f]+", "", text)  # object addresses, DLL handles
    text = re.sub(r"\nFILE\n.*?\n\n|\nMODULE REFERENCE\n.*?\n\n", "\n", text, flags=re.S)  # local paths, URLs
    # Inherited members repeat their base class's docs: drop those sections (up to the next rule or class end).
    text = re.sub(r" *\| *-{70}\n *\|  \w[\w ]* inherited from [^\n]*:\n(?: *\|[^\n]*\n)*?(?= *\| *-{70}\n| *[^ |])",
                  "", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def make_corpus(args):
    import pydoc, pydoc_data.topics
    docs, root, site = [], sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    for name in module_names():
        try:
            mod = safe_import(name)
            file = getattr(mod, "__file__", None) or root                 # built-in modules have none
            if not file.startswith(root) or file.startswith(site):       # e.g. setuptools' distutils shim
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                docs.append((name, clean(pydoc.render_doc(mod, renderer=pydoc.plaintext))))
        except BaseException:                                             # broken or platform-specific modules
            continue
    docs += [("topic:" + k, clean(v)) for k, v in sorted(pydoc_data.topics.topics.items())]
    seen, train, valid = set(), [], []
    for name, text in docs:                    # drop paragraphs seen before (shared docstrings, repeated classes)
        paras = []
        for p in text.split("\n\n"):
            key = hashlib.sha1(p.strip().encode()).digest()
            if len(p) > 40 and key in seen:
                continue
            seen.add(key)
            paras.append(p)
        text = "\n\n".join(paras).strip()
        if len(text) < 200:
            continue
        split = valid if hashlib.sha1(name.encode()).digest()[0] < 256 * 0.05 else train
        split.append(text)
    CORPUS.mkdir(parents=True, exist_ok=True)
    for fname, split in (("train.jsonl", train), ("valid.jsonl", valid)):
        with open(CORPUS / fname, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in split)
    sizes = {s: (CORPUS / f"{s}.jsonl").stat().st_size for s in ("train", "valid")}
    print(f"corpus: {len(train)} train / {len(valid)} valid documents, {sizes} bytes")
    (CORPUS / "README.md").write_text(f"""# Demo corpus
Python {sys.version.split()[0]} standard library documentation: pydoc's plain-text rendering of every
importable public stdlib module (module, class and function docstrings with signatures) plus the language
reference topics shipped in `pydoc_data.topics`. Made by `python recipes/make_demo.py corpus`: modules
in sorted order; object addresses, local file paths and "inherited from" sections removed; paragraphs
longer than 40 characters kept only at their first occurrence; documents under 200 characters dropped;
split by document (a hash of the module name) into train (95%) and validation (5%).

- train.jsonl: {len(train)} documents, {sizes['train'] / 1e6:.2f} MB
- valid.jsonl: {len(valid)} documents, {sizes['valid'] / 1e6:.2f} MB

One `{{"text": ...}}` per line. The text is Python's documentation, under the PSF license.
""")


def read_texts(split):
    return [json.loads(l)["text"] for l in open(CORPUS / f"{split}.jsonl")]


def make_tokenizer(args):
    fast = train_tokenizer(read_texts("train"), args.vocab, MODEL, max_length=512)
    print(f"tokenizer: vocab {len(fast)} saved to {MODEL}")


def train_tokenizer(texts, vocab: int, out, max_length: int):
    """Byte-level BPE of `vocab` entries trained on `texts`, with <s> prepended to each text; saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=max_length)
    fast.save_pretrained(out)
    return fast


def token_ids(tok, texts):
    """One LongTensor of `<s> text </s>` for each text in turn (batches of texts: the Rust tokenizer runs them
    in parallel)."""
    import torch
    chunks = []  # a tensor per batch: a list of Python ints would take ~36 bytes a token
    for i in range(0, len(texts), 512):
        docs = tok(texts[i:i + 512], verbose=False)["input_ids"]
        chunks.append(torch.tensor([t for doc in docs for t in (*doc, tok.eos_token_id)], dtype=torch.long))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)


def pretrain(args):
    from transformers import AutoTokenizer, LlamaConfig
    tok = AutoTokenizer.from_pretrained(MODEL)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=192, intermediate_size=528, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         hidden_act="silu", tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rope_theta=10000.0)
    out = Path(args.out or MODEL)
    result = pretrain_llama(config, tok, token_ids(tok, read_texts("train")), token_ids(tok, read_texts("valid")), out,
                            steps=args.steps, minutes=args.minutes, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                            warmup=args.warmup, eval_every=args.eval_every, device=args.device, seed=args.seed)
    (out / "README.md").write_text(f"""# sparsify demo model
A small Llama-style causal LM with SiLU gated MLPs ({result['parameters']:,} parameters:
hidden {config.hidden_size}, intermediate {config.intermediate_size}, {config.num_hidden_layers} layers,
{config.num_attention_heads} heads, vocabulary {config.vocab_size}, tied embeddings, fp32), pretrained from scratch on
../corpus (Python's standard library documentation) by `python recipes/make_demo.py pretrain`:
AdamW lr {args.lr}, warm-up {args.warmup}, cosine, seed {args.seed}; {result['summary']}.
It is the input of `sparsify convert demo`, which swaps its SiLU gates for ReLU and trains them sparse.
""")


class EpochWindows:
    """The training stream read in epochs, as windows of `length` tokens: each epoch starts at a random offset below
    `length` (so that windows do not always begin at the same tokens) and visits every whole window after it once, in
    a random order. `state_dict` is where it stands, so that a resumed run reads the batches it would have read."""

    def __init__(self, tokens, length: int, seed: int):
        import torch
        if len(tokens) < 2 * length:
            raise ValueError(f"the training stream has {len(tokens)} tokens: fewer than two windows of {length}")
        self.tokens, self.length = tokens, length
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position, self.offset, self.order = 0, 0, 0, None

    def batch(self, size: int):
        """The next `size` windows, [size, length], starting another epoch where this one runs out."""
        import torch
        rows = []
        while len(rows) < size:
            if self.order is None or self.position == len(self.order):
                self.epoch += self.order is not None
                self.offset = int(torch.randint(self.length, (1,), generator=self.generator))
                self.order = torch.randperm((len(self.tokens) - self.offset) // self.length, generator=self.generator)
                self.position = 0
            start = self.offset + self.length * int(self.order[self.position])
            rows.append(self.tokens[start:start + self.length])
            self.position += 1
        return torch.stack(rows)

    @property
    def epochs(self) -> float:
        """Epochs read so far: whole ones and the share of the current one."""
        return 0.0 if self.order is None else self.epoch + self.position / len(self.order)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "offset": self.offset, "order": self.order,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.offset, self.order = (
            state[k] for k in ("epoch", "position", "offset", "order"))
        self.generator.set_state(state["generator"])


def save_pretraining(path, settings: dict, run: dict, model, opt, windows) -> None:
    """The pretraining's state (`run`: step, seconds, best loss and weights, curve; the weights, the optimizer, the
    data reader's position and the RNGs) written to `path` through a temporary file: a kill leaves the last one."""
    import torch
    state = {"settings": settings, "run": run, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "windows": windows.state_dict(), "rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    tmp = Path(f"{path}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_pretraining(path, settings: dict, model, opt, windows) -> dict:
    """The state that save_pretraining wrote to `path`, loaded into `model`, `opt` and `windows`; returns its `run`.
    A state of other settings is refused: resuming it would give neither run."""
    import torch
    state = torch.load(path, map_location="cpu")
    if state["settings"] != settings:
        changed = sorted(k for k in settings.keys() | state["settings"].keys()
                         if settings.get(k) != state["settings"].get(k))
        raise SystemExit(f"{path}: a pretraining state made with other settings (differing in {', '.join(changed)}); "
                         f"run with the same arguments to resume it, or remove it to start again")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    windows.load_state_dict(state["windows"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    print(f"resuming the pretraining at step {state['run']['step']} from {path}", flush=True)
    return state["run"]


def pretrain_llama(config, tok, train, valid, out, *, steps: int, minutes: float, batch: int, seq_len: int, lr: float,
                   warmup: int, eval_every: int, device: str | None = None, seed: int = 0, weight_decay: float = 0.1,
                   state_path=None, save_every: int = 0, stop_after: int | None = None):
    """Pretrain a LlamaForCausalLM of `config` from scratch on the token stream `train` read in epochs of shuffled
    windows (EpochWindows; AdamW, warm-up then cosine to a tenth of `lr`, bf16 autocast on GPU, fp32 weights), until
    `steps` or `minutes`, whichever comes first (the schedule follows the nearer); keeps the weights with the best
    loss on `valid` (consecutive windows) and saves them, a generation config and the tokenizer to `out`.
    With `state_path`, the run's state is saved there every `save_every` steps (0: never) and a call with the same
    arguments resumes from it, with the same result as a run without the interruption (on the CPU bit for bit, while
    the steps bound the schedule: seconds add up over the calls); the file is removed once `out` is written.
    `stop_after`: steps of this call after which it saves the state and returns None (time-limited machines).
    Returns the figures: parameters, steps, tokens, epochs, seconds, best validation loss and the validation curve."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    if stop_after is not None and state_path is None:
        raise ValueError("stop_after needs a state_path to save the state into")
    torch.manual_seed(seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    train = train.to(device)
    print(f"tokens: train {len(train):,}  valid {len(valid):,}")
    model = LlamaForCausalLM(config).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"parameters: {parameters:,}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                            fused=cuda or None)
    windows = EpochWindows(train, seq_len, seed)
    settings = {"config": {k: v for k, v in config.to_dict().items() if k != "transformers_version"}, "steps": steps,
                "minutes": minutes, "batch": batch, "seq_len": seq_len, "lr": lr, "warmup": warmup, "seed": seed,
                "eval_every": eval_every, "weight_decay": weight_decay, "tokens": [len(train), len(valid)]}
    resume = state_path is not None and Path(state_path).is_file()
    run = load_pretraining(state_path, settings, model, opt, windows) if resume else {
        "step": 0, "seconds": 0.0, "best": float("inf"), "best_state": None, "curve": []}
    T = seq_len
    vx = valid[: len(valid) // T * T].view(-1, T)

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = 0.0
        for i in range(0, len(vx), batch):
            with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                x = vx[i:i + batch].to(device)
                out = model(x, labels=x)  # transformers shifts the labels itself
            tot += out.loss.float().item() * len(x)
        model.train()
        return tot / len(vx)

    start, first = time.time() - run["seconds"], run["step"]
    while True:
        step, run["seconds"] = run["step"], time.time() - start
        frac = max(step / steps, run["seconds"] / (60 * minutes))
        if step % eval_every == 0 or frac >= 1:
            loss = evaluate()
            run["curve"].append({"step": step, "tokens": step * batch * T, "seconds": round(run["seconds"], 1),
                                 "valid_loss": loss})
            if loss < run["best"]:
                run["best"], run["best_state"] = loss, {k: v.detach().cpu().clone()
                                                        for k, v in model.state_dict().items()}
            print(f"step {step}  {step * batch * T:,} tokens  epoch {windows.epochs:.2f}  {run['seconds']:.0f}s  "
                  f"valid loss {loss:.3f}  ppl {math.exp(loss):.2f}", flush=True)
        if frac >= 1:
            break
        rate = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = rate
        x = windows.batch(batch)
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            loss = model(x, labels=x).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run["step"] += 1
        pause = stop_after is not None and run["step"] - first >= stop_after
        if state_path is not None and (pause or save_every and run["step"] % save_every == 0):
            run["seconds"] = time.time() - start
            save_pretraining(state_path, settings, run, model, opt, windows)
        if pause:
            print(f"pretraining paused at step {run['step']} of {steps}: its state is in {state_path}", flush=True)
            return None
    step, seconds, best = run["step"], run["seconds"], run["best"]
    model.load_state_dict(run["best_state"])
    out = Path(out)
    model.to(torch.float32).save_pretrained(out)
    # greedy: the same text at every call (pass do_sample=True to generate for variety); no length, which would
    # override a caller's max_length
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    if state_path is not None:
        Path(state_path).unlink(missing_ok=True)
    summary = (f"best validation loss {best:.3f} (perplexity {math.exp(best):.2f}) after {step} steps of "
               f"{batch} x {T} tokens ({windows.epochs:.2f} epochs), {seconds:.0f} s on {device}")
    print(summary, "; saved to", out)
    return {"parameters": parameters, "steps": step, "tokens": step * batch * T, "epochs": round(windows.epochs, 4),
            "seconds": round(seconds, 1), "best_valid_loss": best, "curve": run["curve"], "summary": summary}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["corpus", "tokenizer", "pretrain", "all"])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="folder for the pretrained model (default sparsify/demo/model)")
    args = ap.parse_args()
    for stage, fn in (("corpus", make_corpus), ("tokenizer", make_tokenizer), ("pretrain", pretrain)):
        if args.stage in (stage, "all"):
            fn(args)
