"""Run a converted checkpoint's MLPs through the TwELL kernels on a GPU and compare with the plain load.

The checkpoint is loaded twice: plain (dense ReLU, no remote code) and with trust_remote_code (TwELL).
`--force-sparse TILE COMPRESSION` overrides the plan so every layer runs the kernels, which shows the
wiring on models whose plan is dense (the demo: its layers are too narrow to gain). Kernel calls are
counted where the MLP module routes a call to the kernels (replays of its CUDA graphs included), and
overflowing (row, tile) pairs through an overflow counter passed to the modeling file's `gated_mlp`. Prints
and writes to --json: logits relative error (fp32 and bf16), greedy-generation agreement, calls, overflow.

    python benchmarks/checkpoint_kernel_check.py demo-sparse --force-sparse 64 4 --json out.json
"""
import argparse
import json
import platform
import sys

import torch
import triton
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from twell.layer_plan import ALL_TOKENS, LayerPlan, Mode, layer_plans


def load_pair(path, dtype, force):
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    if force:
        tile, compression = force
        config.twell["layers"] = [LayerPlan(Mode.SPARSE, tile, compression, ALL_TOKENS, plan.stats).to_json()
                                  for plan in layer_plans(config.twell)]
    remote = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=True)
    return plain, remote.cuda().eval()


def count_kernel_calls(remote):
    """Count the MLP calls that take the kernels (replays of the modeling file's CUDA graphs included) and
    the overflowing (row, tile) pairs: the remote module's gated_mlp is wrapped to pass an overflow counter,
    which graphs captured through the wrapper keep adding into. Both loads share the module, so each call
    wraps the original kernel again, with fresh counters."""
    module = sys.modules[type(remote).__module__]
    kernel = getattr(module.gated_mlp, "kernel", module.gated_mlp)
    calls, overflow = [0], torch.zeros(1, dtype=torch.int64, device="cuda")

    def counted(*args, **kwargs):
        return kernel(*args, overflow=overflow, **kwargs)

    counted.kernel = kernel
    module.gated_mlp = counted
    mlp = module.TwellGatedMLP
    use_kernel = getattr(mlp.use_kernel, "original", mlp.use_kernel)

    def counted_use(self, x, tokens):
        use = use_kernel(self, x, tokens)
        calls[0] += use
        return use

    counted_use.original = use_kernel
    mlp.use_kernel = counted_use
    return calls, overflow


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--force-sparse", nargs=2, type=int, metavar=("TILE", "COMPRESSION"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "command": " ".join(sys.argv), "checkpoint": args.checkpoint, "force_sparse": args.force_sparse}
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        plain, remote = load_pair(args.checkpoint, dtype, args.force_sparse)
        calls, overflow = count_kernel_calls(remote)
        ids = torch.randint(3, plain.config.vocab_size, (args.batch, args.seq_len), device="cuda")
        with torch.no_grad():
            dense_logits, twell_logits = plain(ids).logits, remote(ids).logits
            prompt = ids[:1, :16]
            greedy = dict(max_new_tokens=32, do_sample=False)
            dense_tokens = plain.generate(prompt, **greedy)[0, 16:]
            twell_tokens = remote.generate(prompt, **greedy)[0, 16:]
        result[str(dtype).removeprefix("torch.")] = {
            "logits_rel_err": rel_err(twell_logits, dense_logits),
            "greedy_agreement": (dense_tokens == twell_tokens).float().mean().item(),
            "kernel_calls": calls[0],
            "overflow_tiles": int(overflow.item()),
            "tokens": args.batch * args.seq_len,
        }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
