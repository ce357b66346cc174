"""`sparsify analyze`: per-layer gate-activation statistics of any supported model on real text, with
the kernel setting the plan rule would choose for a converted (ReLU) model. Works on original SiLU models
(active = gate pre-activation > 0: the starting point of a conversion; no setting is recommended, since
the kernels compute ReLU) and on converted checkpoints, which load here as plain dense ReLU models.
Without --data, the demo model and checkpoints converted from it use the demo corpus's held-out file;
other models use the data they were converted on (read from the same column) where a file or folder of the
name the checkpoint records (no local path) is in the current folder. On the data a checkpoint trained on,
without a held-out file, it measures no further than the head that the training held out.
"""
from __future__ import annotations

import json
from pathlib import Path

from twell.layer_plan import LayerPlan

from .card import public_name
from .data import MIN_EVAL_TOKENS, measured_blocks
from .errors import ConfigError, DataError, OutputError, SourceError
from .export import converted_config, replace_plan
from .load import check_device, load_config, load_model, require_cuda, require_tokenizer
from .locations import demo_corpus_path, resolve_data, resolve_source
from .measure import measure
from .plan import choose_measure, plan_model
from .report import console, warn


def _entry_without_stats(plan: LayerPlan) -> dict:
    return {key: value for key, value in plan.to_json().items() if key != "stats"}


def training_record(config) -> dict:
    """A converted checkpoint's record of its training (config.json's twell.training; empty for another model)."""
    return (getattr(config, "twell", None) or {}).get("training", {})


def default_data(source: str) -> tuple[str | Path, str]:
    """The text to analyze `source` on when --data is not given, and the column of its rows to read."""
    if source == "demo":
        return demo_corpus_path(), "text"
    config, _ = load_config(source)
    training = training_record(config)
    if training.get("base_model") == "demo":
        return demo_corpus_path(), "text"
    recorded = training.get("data")
    if recorded and Path(recorded).exists():
        return recorded, training.get("text_column", "text")
    converted_on = f" (it was converted on {recorded}, no file or folder here)" if recorded else ""
    raise DataError(f"--data is required for this model{converted_on}: local .txt/.json/.jsonl/.parquet files or "
                    "folder, or a datasets name")


def held_out_head(config, data, seq_len: int) -> int | None:
    """The tokens a converted checkpoint (of `config`) held out at the head of `data`, in whole `seq_len`
    blocks, where `data` is the text it trained on (by the name it records) and holds no held-out file: its
    training read on from there. None elsewhere."""
    training = training_record(config)
    head = training.get("eval_tokens")
    if not head or training.get("data") != public_name(data) or resolve_data(data).eval is not None:
        return None
    return max(seq_len, head // seq_len * seq_len)


def default_seq_len(config, source: str) -> int:
    """The sequence length to analyze `source` (of `config`) at when --seq-len is not given: the one a
    converted checkpoint was trained at, else the one `convert` would use (its default recipe)."""
    from .recipe import load_recipe

    trained = training_record(config).get("seq_len")
    return trained or load_recipe(None, source).get("seq_len", 1024)


def analyze(
    source: str,
    *,
    data: str | None = None,
    text_column: str | None = None,
    tokens: int = 65536,
    seq_len: int | None = None,
    batch_size: int = 8,
    device: str | None = None,
    json_path: str | Path | None = None,
    measure_kernels: bool | None = None,
    write_plan: bool = False,
) -> dict:
    """{"model", "data", "seq_len", "tokens", "perplexity", "converted", "layers": [statistics + "recommended"]};
    "recommended" is the layer's LayerPlan (in the JSON file its entry without stats, which the layer's own
    statistics hold), None for a model that is not converted (its gate is not ReLU). `text_column`: the column
    of the data's rows that holds the text (default "text"; without `data`, the one the recorded data was read
    from). `measure_kernels`: recommend by timing the kernel settings on this GPU instead of by the cost model
    (None: as convert, timed on a GPU where the cost model does not cover the layer shape).
    `write_plan`: give the checkpoint (a local converted one) the recommended plan (export.replace_plan), e.g.
    timed on the GPU that will serve it."""
    check_device(device)
    if data is None:
        data, recorded_column = default_data(source)
        text_column = text_column or recorded_column
    if measure_kernels:
        require_cuda(device, "--measure")
    folder = None
    if write_plan:  # a plan this version can replace, checked before anything is measured
        try:
            folder = resolve_source(source)  # "~" and "demo" as load_model reads them
            converted_config(folder)
        except (OutputError, SourceError) as error:
            raise ConfigError(f"--write-plan: {source} is not a local converted checkpoint ({error})") from None
    model, tokenizer, spec = load_model(source, device=device)
    require_tokenizer(tokenizer, source, model.config)
    seq_len = seq_len or default_seq_len(model.config, source)
    seq_len = min(seq_len, getattr(model.config, "max_position_embeddings", seq_len))
    head = held_out_head(model.config, data, seq_len)
    if head is not None and tokens > head:
        warn(f"measuring {head:,} tokens, not {tokens:,}: the checkpoint trained on {data} after the {head:,} it "
             f"held out")
        tokens = head
    blocks, read = measured_blocks(data, tokenizer, seq_len, tokens, text_column or "text")
    measured = sum(block.numel() for block in blocks)
    if measured < min(tokens, MIN_EVAL_TOKENS):  # fewer than asked, and few (the table's title gives the count)
        warn(f"measuring {measured:,} tokens, all that {read} holds, not --tokens {tokens:,}: too few for steady "
             "figures")
    stats = measure(model, spec, blocks, batch_size, label=f"measuring ({measured:,} tokens)")
    activation = getattr(model.config, spec.act_key)
    converted = activation == "relu"
    measure_kernels = choose_measure(measure_kernels, model.config, device, converted and console.print)
    plans = (plan_model(model, spec, stats, blocks, measure_kernels=measure_kernels, device=device)
             if converted else [None] * len(stats["layers"]))
    for layer, plan in zip(stats["layers"], plans):
        layer["recommended"] = plan
    # named without local paths, as the checkpoint's own records: the JSON may be written into it (and pushed)
    data_name = "demo corpus" if Path(data) == demo_corpus_path() else public_name(data)
    result = {"model": public_name(source), "family": spec.family, "data": data_name, "seq_len": seq_len,
              "converted": converted, "activation": activation, **stats}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1, default=_entry_without_stats))
    if write_plan:
        replace_plan(folder, plans)
    return result
