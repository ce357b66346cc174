"""Where an eager greedy `generate` step of a converted checkpoint spends host time, dense load against
the TwELL (remote-code) load: torch.profiler over a few decode steps, top operators by self CPU time.

    python benchmarks/profile_decode.py --layers 2 --active 29
"""
import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from model_bench import build_model, export, host_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--active", type=float, default=29)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    path = export(build_model(layers=args.layers, active=args.active, device="cuda"),
                  Path(tempfile.mkdtemp()) / "ckpt", active=args.active)
    prompt = torch.randint(0, 32000, (1, 16), device="cuda")
    for name, remote in (("dense", False), ("twell", True)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, trust_remote_code=remote).cuda().eval()
        mlp, x = model.model.layers[0].mlp, torch.randn(1, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            print(f"{name}: one layer's MLP module at 1 token, issued back to back: {host_us(lambda: mlp(x)):.1f} us a call")
        generate = lambda: model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                          do_sample=False)
        with torch.no_grad():
            generate()
            generate()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                generate()
                torch.cuda.synchronize()
        print(f"=== {name}: {args.new_tokens} new tokens, {args.layers} layers")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
