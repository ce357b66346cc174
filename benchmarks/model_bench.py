"""Model-level dense vs TwELL benchmark on a 1.5B-shape Llama with controlled sparsity (GPU).

The model: the paper's shape (D = 2048, I = 5632, 16 heads, no GQA, vocabulary 32000), a few layers,
random weights, ReLU gate. Sparsity is controlled by a bias channel (docs/performance.md): hidden dimension
BIAS of every token embedding is a constant, and no layer writes to it (row BIAS of o_proj and down_proj
is zero), so it reaches every MLP input as x_b = a * sqrt(D) / ||h|| after the RMSNorm (weight 1). Gate
rows are N(0, 1/D) except gate[:, BIAS] = s, so a unit fires where g . x_rest > -s * x_b. Layer by layer
(each layer's input depends on the layers before), s is set on calibration tokens to the (1 - k/I)
quantile of -g . x_rest / x_b: exactly k active units per token on average there. up ~ N(0, 1/D) and
down ~ N(0, 1/k) as in the block benchmark. The mean active units on the benchmark's own input are
measured by `sparsify bench` and reported next to the target: the figures go with the measured value.

The model is exported as a converted checkpoint (export_checkpoint, plan from plan_layers on `measure`
statistics) and benchmarked with `sparsify.bench.bench_checkpoint` (prefill, eager and compiled generate,
CUDA-graph decode step, each with its breakdown; the uncompiled decode step's replay also for the TwELL load with
its attention projections on torch's linear instead of small_linear: `small_linear_speedup`); JSON per target under
--out, with the command line and the seconds each stage took.

  python benchmarks/model_bench.py --active 29 --layers 28 --out results/model     # the paper's 1.5B shape
  python benchmarks/model_bench.py --quick --out /tmp/smoke                        # 4 layers, fewer rows
  python benchmarks/model_bench.py --active 29 --layers 28 --prefill-batch 1x64 --generate-batch 1 8 \
      --compiled-batch --compiled-prefill-batch --out results/model                # one short prefill, the decode rows
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsify.bench import bench_checkpoint, bench_table, versions, write_json
from sparsify.export import export_checkpoint
from sparsify.families import spec_for
from sparsify.measure import measure
from sparsify.plan import measure_plan, plan_layers

BIAS = 0          # the constant residual channel
BIAS_VALUE = 1.0  # its value in every token embedding


@torch.no_grad()
def build_model(*, hidden: int = 2048, intermediate: int = 5632, layers: int = 4, heads: int = 16,
                vocab: int = 32000, active: float = 29, calibration_tokens: int = 2048, seed: int = 0,
                device: str = "cpu") -> LlamaForCausalLM:
    """Random fp32 ReLU Llama whose MLPs average `active` units per token on calibration text."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab, hidden_act="relu",
                         max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    model.model.embed_tokens.weight[:, BIAS] = BIAS_VALUE
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.gate_proj.weight.normal_(0, hidden ** -0.5)
        mlp.up_proj.weight.normal_(0, hidden ** -0.5)
        mlp.down_proj.weight.normal_(0, active ** -0.5)
        mlp.down_proj.weight[BIAS] = 0  # nothing writes into the bias channel
        layer.self_attn.o_proj.weight[BIAS] = 0
    seq = min(512, calibration_tokens)
    ids = torch.randint(0, vocab, (max(1, calibration_tokens // seq), seq), device=device)
    for layer in model.model.layers:  # in order: a layer's input depends on the gates before it
        captured = []
        handle = layer.mlp.register_forward_pre_hook(lambda mod, args: captured.append(args[0].flatten(0, -2)))
        try:
            model.model(input_ids=ids, use_cache=False)
        finally:
            handle.remove()
        x = captured[0].float()
        gate = layer.mlp.gate_proj.weight
        gate[:, BIAS] = 0
        ratio = (x @ gate.t()) / x[:, BIAS:BIAS + 1]  # a unit fires where ratio > -s
        k = max(1, round(ratio.numel() * (1 - active / intermediate)))
        gate[:, BIAS] = -ratio.flatten().kthvalue(k).values
    return model


def export(model, out: Path, *, active: float, eval_tokens: int = 4096, measure_kernels: bool = False) -> Path:
    """The model as a converted checkpoint (bf16 on CUDA, as convert exports) planned on fresh tokens, by
    the cost model or, with `measure_kernels`, by timings (sparsify.plan.measure_plan; the cost model's plan is kept in
    the training section for comparison)."""
    spec = spec_for(model.config)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(1)
    seq = min(512, eval_tokens)
    blocks = list(torch.randint(0, model.config.vocab_size, (max(1, eval_tokens // seq), seq), generator=generator))
    stats = measure(model, spec, blocks)
    plan = plan_layers(stats["layers"], hidden_size=model.config.hidden_size)
    cost_model_plan = [layer.to_json() for layer in plan]
    if measure_kernels:
        plan = measure_plan(model, spec, blocks, device=device)
    if device.type == "cuda":
        model.to(torch.bfloat16)
    training = {"base_model": "synthetic", "recipe": "benchmarks/model_bench.py: random weights, bias channel",
                "target_active": active, "measured_active": [layer["mean_active"] for layer in stats["layers"]],
                "tokens": 0, "steps": 0, "cost_model_plan": cost_model_plan}
    return export_checkpoint(model, None, out, spec=spec, plan=plan, training=training, overwrite=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--active", type=float, nargs="+", default=[29.0], help="Target mean active units.")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prefill-batch", nargs="+", default=["1", "8", "64", "64x64", "16x256", "1x64"],
                        help="Prefill rows: BATCH (sequences of --seq-len tokens) or BATCHxLENGTH.")
    parser.add_argument("--generate-batch", type=int, nargs="*", default=[1, 8],
                        help="Batch sizes of eager generate and the CUDA-graph step (none: skip them).")
    parser.add_argument("--compiled-batch", type=int, nargs="*", default=[1, 8],
                        help="Batch sizes of compiled static-cache generate, the compiled CUDA-graph step and "
                             "generate_graphed (none: skip them).")
    parser.add_argument("--compiled-prefill-batch", type=int, nargs="*", default=[64],
                        help="Batch sizes of the prefill through torch.compile (none: skip it).")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generate-repeats", type=int, default=7, help="Timed calls per load of the generate paths.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: 4 layers, prefill at batch 1 and 8 (compiled at 8), decode paths at batch 1, "
                             "32 new tokens, 2 repeats of every path (overrides those options).")
    parser.add_argument("--out", type=Path, required=True, help="Folder for the JSON results.")
    parser.add_argument("--work", type=Path, help="Folder for the checkpoints (default: a temporary one).")
    parser.add_argument("--measure", action="store_true",
                        help="Plan by timing the kernel settings (as convert --measure).")
    parser.add_argument("--fp8-gate", action="store_true", help="The TwELL load's gate pass in fp8 (sparsify bench's).")
    parser.add_argument("--fp8-up-down", action="store_true",
                        help="The TwELL load's out pass on e4m3 up and down rows (sparsify bench's).")
    args = parser.parse_args(argv)
    for option in ("layers", "seq_len", "decode_tokens", "decode_context", "repeats", "generate_repeats"):
        if getattr(args, option) < 1:  # before any GPU work (bench_checkpoint checks them after the build)
            parser.error(f"--{option.replace('_', '-')} must be positive, got {getattr(args, option)}")
    if args.quick:
        args.layers, args.prefill_batch, args.generate_batch, args.compiled_batch = 4, ["1", "8", "64x64"], [1], [1]
        args.compiled_prefill_batch = [8]
        args.decode_tokens, args.repeats, args.generate_repeats = 32, 2, 2
    from rich.console import Console

    console = Console()
    work = args.work or Path(tempfile.mkdtemp(prefix="model-bench-"))
    for active in args.active:
        start = time.perf_counter()
        model = build_model(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, active=active,
                            device="cuda")
        path = export(model, work / f"llama-k{active:g}", active=active, measure_kernels=args.measure)
        del model
        torch.cuda.empty_cache()
        built = time.perf_counter()
        result = bench_checkpoint(path, seq_len=args.seq_len, prefill_batches=args.prefill_batch,
                                  generate_batches=args.generate_batch, compiled_batches=args.compiled_batch,
                                  compiled_prefill_batches=args.compiled_prefill_batch,
                                  decode_tokens=args.decode_tokens, decode_context=args.decode_context,
                                  repeats=args.repeats, generate_repeats=args.generate_repeats, fp8_gate=args.fp8_gate,
                                  fp8_up_down=args.fp8_up_down)
        twell_section = json.loads((path / "config.json").read_text())["twell"]
        result.update(command="python " + " ".join(sys.argv), target_active=active,
                      shape={"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers},
                      seconds={"build_and_export": built - start, "bench": time.perf_counter() - built},
                      plan_stats=twell_section["layers"], cost_model_plan=twell_section["training"]["cost_model_plan"])
        console.print(bench_table(result))
        console.print(f"plan: {result['plan']['layers']}; mean active per layer on the bench input: "
                      f"{[round(a, 1) for a in result['mean_active']]}"
                      + (f"; with the fp8 gate: {[round(a, 1) for a in result['fp8_gate_mean_active']]}"
                         if args.fp8_gate else "") + f"; seconds: {result['seconds']}")
        suffix = "".join(name for name, chosen in (("_measured", args.measure), ("_fp8", args.fp8_gate),
                                                   ("_ud8", args.fp8_up_down)) if chosen)
        name = f"model_bench_k{active:g}_l{args.layers}{suffix}.json"
        console.print(f"wrote {write_json(result, args.out / name)}")
    console.print(f"versions: {versions()}")


if __name__ == "__main__":
    main()
