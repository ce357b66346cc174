"""Held-out cross-entropy of a converted checkpoint with the opt-in fp8 numerics, on text of your own: its gate
pass in fp8 (`use_fp8_gate`), its up and down rows in e4m3 (`use_fp8_up_down`) and both, against the checkpoint
as it is (bf16 on a GPU, fp32 on a CPU), with each layer's active units a token. The projections are computed as
the kernels compute them (metrics.py's FP8_VARIANTS) on every token of the plain dense load: likely an
overestimate of the change, as the kernels read the weights themselves for heavy rows, overflowing tiles and
smaller calls.
Text as `sparsify convert --data` takes it (a file, a folder's held-out valid* files, a dataset name).

  python benchmarks/quality/fp8_quality.py CHECKPOINT --data TEXT [--tokens 262144] [--json result.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import metrics


def measure(checkpoint: str, data: str, tokens: int, seq_len: int, batch: int, device: str,
            text_column: str = "text") -> dict:
    """{"blocks", "plain": scores with active units, and one entry a variant: the same with its relative change}."""
    import torch
    from transformers import AutoTokenizer

    from sparsify.data import measured_blocks

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    found, read = measured_blocks(data, tokenizer, seq_len, tokens, text_column)
    blocks = torch.stack(found)
    model = metrics.load(Path(checkpoint), device)
    with torch.no_grad(), metrics.active_units(model) as active:
        plain = dict(metrics.scores(model, blocks, batch, device), active_units=active)
    variants = metrics.fp8_variant_scores(model, [blocks], batch, device)
    for scores in variants.values():
        scores["cross_entropy_change"] = scores["cross_entropy"] / plain["cross_entropy"] - 1
    return {"text": read, "blocks": list(blocks.shape), "plain": plain, **variants}


def main(argv: list[str] | None = None) -> dict:
    import torch

    from sparsify.bench import versions
    from sparsify.errors import SparsifyError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a converted checkpoint's folder")
    ap.add_argument("--data", required=True, help="held-out text: a file, a folder (its valid* files) or a dataset")
    ap.add_argument("--text-column", default="text", help="the column that holds the text (JSON, Parquet, datasets)")
    ap.add_argument("--tokens", type=int, default=262_144, help="held-out tokens to measure (whole blocks)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="blocks a forward pass")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    if min(args.tokens, args.seq_len, args.batch) < 1:
        ap.error("--tokens, --seq-len and --batch must be positive")
    if not (Path(args.checkpoint) / "config.json").is_file():
        ap.error(f"{args.checkpoint}: no config.json there (give a converted checkpoint's folder)")
    try:
        measured = measure(args.checkpoint, args.data, args.tokens, args.seq_len, args.batch, args.device,
                           args.text_column)
    except SparsifyError as error:  # the data: missing, empty, shorter than one block
        ap.error(str(error))
    result = dict(measured,
                  checkpoint=args.checkpoint, device=torch.cuda.get_device_name(args.device)
                  if args.device.startswith("cuda") else "cpu", versions=versions(),
                  command="python " + " ".join(sys.argv if argv is None else ["fp8_quality.py", *argv]))
    plain = result["plain"]
    print(f"{args.checkpoint} on {result['text']} ({result['blocks'][0]} x {result['blocks'][1]} tokens): "
          f"CE {plain['cross_entropy']:.4f}, top-1 {100 * plain['accuracy']:.2f}%")
    for name in metrics.FP8_VARIANTS:
        r = result[name]
        print(f"  {name}: CE {r['cross_entropy']:.4f} ({100 * r['cross_entropy_change']:+.3f}%), "
              f"top-1 {100 * r['accuracy']:.2f}%, active units {sum(r['active_units']) / len(r['active_units']):.1f} "
              f"a token (plain {sum(plain['active_units']) / len(plain['active_units']):.1f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
