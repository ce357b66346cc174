"""GPU check of a conversion whose training state does not fit one GPU: FSDP2 over the GPUs of one machine.

1. Builds a SiLU Llama of the given shape with random weights and the demo tokenizer (default: Llama-2-7B's
   decoder, 32 x 4096 / 11008, 6.5B parameters with the 4096-entry vocabulary: 97 GiB of fp32 weights,
   gradients and AdamW state, above one 80 GB GPU) and saves it as a standard HF checkpoint.
2. Runs a one-process `sparsify convert` of it, which must stop before reading a weight and name FSDP.
3. Converts it with `accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes N -m cli
   convert` on the demo corpus (gradient checkpointing on), the trainer logging loss, the busiest GPU's peak
   memory and tokens/s; with --save-every, also the seconds each periodic save of the sharded training state
   takes (beside the launcher's 30 s between a Ctrl-C and its SIGKILL of the workers).
4. Checks the export: the same tensor names and shapes as the source (standard HF layout), and it loads both
   ways, as a plain dense ReLU model and with trust_remote_code on the TwELL modeling file, with their
   logits on held-out text compared.
The weights are random, so this measures that the sharded path runs and what it costs, not conversion quality
(docs/quality.md). Everything goes into one JSON with the device and versions.

    python benchmarks/fsdp_scale_check.py --json out/fsdp_scale_check.json     # all GPUs of this machine
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from twell.layer_plan import layer_plans  # noqa: E402

from sparsify.bench import versions  # noqa: E402
from sparsify.locations import demo_corpus_path, demo_model_path  # noqa: E402
from sparsify.train import TRAINING_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def build_source(path: Path, layers: int, hidden: int, intermediate: int, heads: int, seed: int) -> int:
    """A randomly initialised SiLU Llama with the demo tokenizer, saved in bf16; returns its parameter count."""
    demo = LlamaConfig.from_pretrained(demo_model_path())
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=demo.vocab_size,
                         max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False,
                         bos_token_id=demo.bos_token_id, eos_token_id=demo.eos_token_id, pad_token_id=demo.pad_token_id)
    torch.manual_seed(seed)
    with torch.device("cuda"):  # initialised on the GPU: seconds, where the CPU takes minutes at 7B
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / name, path / name)
    del model
    torch.cuda.empty_cache()
    return count


def tensor_shapes(folder: Path) -> dict[str, list[int]]:
    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def run_shown(command: list[str]) -> tuple[int, str]:
    """Runs `command` in the checkout, printing its output (stdout and stderr) line by line as it comes, so
    that a long conversion shows its progress; returns its exit code and that output."""
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return process.returncode, "".join(lines)


def convert_command(source: Path, out: Path, recipe: Path, extra: list[str]) -> list[str]:
    return ["-m", "cli", "convert", str(source), "-o", str(out), "--data", str(demo_corpus_path()),
            "--recipe", str(recipe), "--overwrite", *extra]


def load_check(checkpoint: Path, tokens: int) -> dict:
    """The export loaded plainly (dense ReLU) and with remote code (TwELL modeling file): their logits on the
    first `tokens` held-out tokens and on its first token alone (where the plan puts layers on the sparse
    kernels), as the largest difference relative to the largest plain logit, and how many of 16 greedy
    tokens agree."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = " ".join(json.loads(line)["text"] for line in open(demo_corpus_path() / "valid.jsonl"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens].cuda()
    result, logits, first_token, generated = {}, {}, {}, {}
    for name, remote in (("plain", False), ("remote_code", True)):
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda",
                                                     trust_remote_code=remote)
        loaded = time.perf_counter() - started
        with torch.no_grad():
            logits[name] = model(ids).logits.float()
            first_token[name] = model(ids[:, :1]).logits.float()  # one token: the plan's decode window (sparse layers)
        generated[name] = model.generate(ids[:, :32], max_new_tokens=16, do_sample=False)[0, 32:]
        twell = getattr(model.config, "twell", None)
        result[name] = {"class": type(model).__name__, "load_s": round(loaded, 1),
                        "sparse_layers": (sum(plan.is_sparse for plan in layer_plans(twell))
                                          if remote and twell else None)}
        del model
        torch.cuda.empty_cache()
    result["logit_diff_rel"] = ((logits["plain"] - logits["remote_code"]).abs().max()
                                / logits["plain"].abs().max()).item()
    result["one_token_logit_diff_rel"] = ((first_token["plain"] - first_token["remote_code"]).abs().max()
                                          / first_token["plain"].abs().max()).item()
    result["generated_tokens_equal"] = (generated["plain"] == generated["remote_code"]).sum().item()
    result["argmax_agreement"] = (logits["plain"].argmax(-1) == logits["remote_code"].argmax(-1)).float().mean().item()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count(),
                        help="FSDP processes (default: all GPUs).")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4, help="Sequences per micro-batch and GPU.")
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--save-every", type=int, default=0,
                        help="Passed to convert: save the sharded training state every N steps, each save timed.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_scale_check"))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if args.gpus < 2:
        sys.exit(f"fsdp_scale_check: needs 2 or more GPUs, this machine has {torch.cuda.device_count()}")

    args.work.mkdir(parents=True, exist_ok=True)
    source, out = args.work / "source", args.work / "sparse"
    # the pretrained recipe with this check's short settings, without distillation: its whole bf16 teacher
    # (13 GiB at 6.5B parameters) would not fit beside this check's 70 GiB peak on an 80 GiB GPU
    recipe = args.work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "recipes" / "pretrained.yaml").read_text()),
                                      "eval_tokens": args.eval_tokens, "log_every": 5, "warmup_steps": 5,
                                      "l1_warmup_steps": 5, "distill": 0.0}))
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    result = {"device": torch.cuda.get_device_name(), "gpus": args.gpus, "gpu_memory_gib": gpu_bytes / 2**30,
              "versions": {**versions(), "accelerate": __import__("accelerate").__version__},
              "command": "python benchmarks/fsdp_scale_check.py " + " ".join(sys.argv[1:]),
              "shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate}}

    started = time.perf_counter()
    parameters = build_source(source, args.layers, args.hidden, args.intermediate, args.heads, seed=0)
    result["parameters"] = parameters
    result["training_state_gib"] = TRAINING_BYTES * parameters / 2**30
    result["build_source_s"] = round(time.perf_counter() - started, 1)
    print(f"source: {parameters / 1e9:.2f}B parameters, training state {result['training_state_gib']:.0f} GiB, "
          f"GPU {gpu_bytes / 2**30:.0f} GiB", flush=True)

    train = ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
             "--grad-checkpointing", *(["--save-every", str(args.save_every)] if args.save_every else [])]
    one = subprocess.run([sys.executable, *convert_command(source, args.work / "one", recipe, train)],
                         capture_output=True, text=True, cwd=ROOT)
    message = (one.stdout + one.stderr).strip().splitlines()
    result["one_process"] = {"returncode": one.returncode, "message": message[-1] if message else "",
                             "wrote_output": (args.work / "one").exists() and any((args.work / "one").iterdir())}
    print("one process:", result["one_process"], flush=True)

    started = time.perf_counter()
    returncode, output = run_shown([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                    str(ROOT / "recipes" / "accelerate" / "fsdp.yaml"), "--num_processes",
                                    str(args.gpus), *convert_command(source, out, recipe, train)])
    result["fsdp"] = {"returncode": returncode, "wall_s": round(time.perf_counter() - started, 1)}
    if args.save_every:  # the trainer's "saved in N s" lines
        result["fsdp"]["save_seconds"] = [float(s) for s in re.findall(r"saved in ([0-9.]+) s", output)]
    if returncode == 0:
        log = json.loads((out / "training_log.json").read_text())
        result["fsdp"].update(
            perplexity=log["training"]["perplexity"], train_seconds=log["training"]["seconds"],
            log=[{k: e.get(k)
                  for k in ("step", "loss", "cross_entropy", "mean_active", "max_memory_gib", "tokens_per_s")}
                 for e in log["log"]])
        source_shapes, export_shapes = tensor_shapes(source), tensor_shapes(out)
        result["export"] = {"same_tensors_as_source": source_shapes == export_shapes,
                            "files": sorted(p.name for p in out.iterdir()),
                            "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}
        result["load"] = load_check(out, tokens=512)
    print(json.dumps({k: v for k, v in result.items() if k != "versions"}, indent=1), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    if returncode or result["one_process"]["returncode"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
