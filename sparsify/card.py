"""The model card (README.md) of a converted checkpoint: Hub metadata through huggingface_hub's
ModelCardData, then the per-layer sparsity table, the training settings and how to load the model."""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData, hf_hub_download
from huggingface_hub.repocard import metadata_load
from huggingface_hub.utils import HFValidationError, validate_repo_id

from twell.layer_plan import LayerPlan

from .report import describe

TAGS = ["sparsify", "twell", "relu", "activation-sparsity", "sparse"]
WHERE = "<this repo or folder>"  # the card's name for the checkpoint in code, until a push names its repo


def is_hub_id(name) -> bool:
    """Whether `name` reads as a Hub repository id (owner/name, as the Hub validates it: not ./x or ../x) and
    is no local path."""
    if not isinstance(name, str) or name.count("/") != 1 or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def source_license(where: str) -> str | dict | None:
    """The license that the model card of `where` (a local checkpoint folder, or a Hub id) declares in its
    metadata, which a checkpoint converted from it keeps: its id, or for `license: other` a dict of it with the
    card's license_name and license_link (the Hub's metadata names a custom license by these; a link relative to
    a Hub source's repository made absolute, the checkpoint not holding that file); None where it has no card,
    declares none, or the card cannot be read (no network)."""
    try:
        readme = Path(where) / "README.md" if Path(where).is_dir() else Path(hf_hub_download(where, "README.md"))
        metadata = (metadata_load(readme) or {}) if readme.is_file() else {}  # a card may have none
    except Exception:  # unreachable Hub, unparsable metadata: the checkpoint records none rather than fail
        return None
    license = metadata.get("license")
    if license != "other":
        return license
    terms = {key: metadata[key] for key in ("license", "license_name", "license_link") if metadata.get(key)}
    link = terms.get("license_link")
    if isinstance(link, str) and "://" not in link and is_hub_id(where):
        terms["license_link"] = f"https://huggingface.co/{where}/blob/main/{link.removeprefix('./')}"
    return terms


# files at the top of a model repository that state its terms; licenses such as Llama's ask that a redistribution
# carry them
LICENSE_FILES = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY", "COPYING")


def is_license_file(name: str) -> bool:
    return "/" not in name and name.upper().startswith(LICENSE_FILES)


def source_license_files(where: str) -> dict[str, bytes] | None:
    """The license and notice files at the top of the source `where` (a local folder, or a Hub id), by name, which
    a checkpoint trained from it carries; None where a Hub source's files cannot be listed (no network)."""
    try:
        if Path(where).is_dir():
            paths = [path for path in Path(where).iterdir() if path.is_file() and is_license_file(path.name)]
        else:
            paths = [Path(hf_hub_download(where, name)) for name in HfApi().list_repo_files(where)
                     if is_license_file(name)]
        return {path.name: path.read_bytes() for path in sorted(paths)}
    except Exception:  # unreachable Hub: the conversion goes on and says so
        return None


def public_name(where: str | Path) -> str:
    """A source or data argument as the checkpoint records it: a local path by its last component (the
    checkpoint may be pushed, and a local path means nothing elsewhere), else as given (a Hub name)."""
    path = Path(where).expanduser()
    return path.resolve().name if path.exists() else str(where)


def objective(training: dict) -> str:
    """The training loss, as the `training` record's settings made it (relative or absolute weight, L1 or the log
    penalty, a weight steered to a sparsity, distillation)."""
    l1 = training.get("l1")
    coefficient = "l1" if l1 is None else f"{l1:g}"
    scale = training.get("l1_log_scale") or 0
    term = "P" if scale else "L1"
    penalty = (f"{coefficient} * {term} / {term}_0, {term}_0 the {term} term at the first step"
               if training.get("l1_relative") else f"{coefficient} * {term}")
    if scale:
        penalty += (f"; P the sum over the MLP units of eps * log(1 + |h| / eps), eps {scale:g} times the layer's mean "
                    "|h| over its firing units at the first step")
    if training.get("target_sparsity"):
        penalty += f"; the weight steered towards {training['target_sparsity']:.1%} of the units silent"
    weight = training.get("distill") or 0
    fit = f"{1 - weight:g} * cross-entropy + {weight:g} * KL(source || trained)" if weight else "cross-entropy"
    hidden = training.get("distill_hidden") or 0
    if hidden:
        fit += f" + {hidden:g} * hidden-state distance to the source"
    return f"loss = {fit} + {penalty}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _text(value) -> str:
    """A setting's value as the card's table shows it: 4 significant digits, thousands grouped, no quotes."""
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(_text, value))
    if isinstance(value, dict):
        return ", ".join(f"{key} {_text(item)}" for key, item in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


# limits of the run, shown beside what it reached: key -> (the key of the limit, how the limit reads)
LIMITS = {"steps": ("max_steps", "at most"), "tokens": ("max_tokens", "at most"),
          "eval_tokens": ("max_eval_tokens", "of")}


def training_table(training: dict) -> str:
    """Markdown table of the `training` record: one row a setting, each value as text (_text), each limit beside
    what was reached where they differ ("2,000 (of 4,096)") instead of a row of its own."""
    limits = {limit for limit, _ in LIMITS.values()}
    rows = ["| setting | value |", "|---|---|"]
    for key, value in training.items():
        if key in limits:
            continue
        limit, reads = LIMITS.get(key, (None, None))
        bound = training.get(limit)
        shown = _text(value) + (f" ({reads} {_text(bound)})" if bound is not None and bound != value else "")
        rows.append(f"| {key} | {shown} |")
    return "\n".join(rows)


def layer_table(plan: list[LayerPlan], intermediate_size: int) -> str:
    """Markdown table: layer, mean active units per token, sparsity %, dead %, kernel setting."""
    rows = ["| layer | mean active units | sparsity % | dead units % | setting |", "|---:|---:|---:|---:|---|"]
    for index, layer in enumerate(plan):
        mean = layer.mean_active
        sparsity = None if mean is None else 1 - mean / intermediate_size
        active = "-" if mean is None else f"{mean:.1f}"
        dead = _percent(layer.stats.get("dead_frac"))
        rows.append(f"| {index} | {active} | {_percent(sparsity)} | {dead} | {describe(layer)} |")
    return "\n".join(rows)


def kernel_summary(plan: list[LayerPlan]) -> str:
    """Which layers' MLPs the checkpoint's own code runs on the kernels, as the card says it."""
    sparse = sum(layer.is_sparse for layer in plan)
    if not sparse:
        return (f"None of its {len(plan)} layers is planned on the TwELL sparse kernels (the plan found no token count "
                "at which they gain; table below): every MLP runs the dense ReLU math, with or without its remote "
                "code.")
    return (f"On a CUDA GPU, {sparse} of its {len(plan)} layers' MLPs run on TwELL sparse Triton kernels at the "
            "token counts where their plan says the kernels gain (table below), the others dense; on a CPU every "
            "MLP runs the dense ReLU math.")


def license_summary(license, base, files: list[str]) -> str:
    """The card's license section: `license` as source_license recorded it, of the base model `base`, and the
    base's license `files` this folder carries."""
    carried = f" Its files of terms are beside the weights: {', '.join(f'`{name}`' for name in files)}." if files else ""
    if license is None:
        return (f"`{base}` declares no license in its model card metadata: its own terms hold for these weights, "
                f"which are trained from it.{carried}")
    if isinstance(license, dict):
        name = license.get("license_name", license["license"])
        link = license.get("license_link")
        license = f"{name} ({link})" if link else name
    return f"`{license}`, the license of `{base}`, whose weights these are trained from.{carried}"


def loading_section(architecture: str) -> str:
    """The card's "How to load": both loads of a checkpoint of transformers' class `architecture`, what remote code
    runs, and how `generate` decodes."""
    return f"""## How to load

```python
from transformers import AutoModelForCausalLM

# the planned layers' MLPs on the TwELL kernels on a CUDA GPU with `triton`; the others the dense ReLU math
model = AutoModelForCausalLM.from_pretrained("{WHERE}", trust_remote_code=True)

# or, running none of this repository's code: the same weights as transformers' own {architecture} with a ReLU
# gate (`hidden_act: relu`), a dense model with the same logits up to float rounding
model = AutoModelForCausalLM.from_pretrained("{WHERE}")
```

`trust_remote_code=True` runs the Python files beside the weights: `modeling_twell.py` (the model class:
{architecture} with each MLP swapped for one that keeps its projections, so the weights load unchanged),
`generation.py` (the decode loop of `generate`) and the TwELL kernel files. They import torch, transformers and
triton only; without triton the MLPs run dense. `save_pretrained` from that load writes them beside the new
weights again; a folder saved from the plain load lacks them, and loads without `trust_remote_code` only.

`model.generate` (and `pipeline("text-generation", ...)`) decodes with no Python between tokens where the
call fits (greedy, or `do_sample=True` with `temperature`, `top_k`, `top_p`; prompts padded on the left; a
streamer): on a GPU each token is one CUDA-graph replay of the decode step (the first call of a batch size
captures it; later calls that fit its cache reuse it). Other calls (beam search, logits processors, ...) and
`graphed=False` run transformers' own `generate`. With `cache_implementation="static"`, or through
`generate_graphed` (generation.py), the step is compiled too, the fastest:

```python
model.generate(input_ids, max_new_tokens=64, cache_implementation="static")
model.generate_graphed(input_ids, max_new_tokens=64, compile=True)
```

"""


def model_card(*, family: str, architecture: str, plan: list[LayerPlan], training: dict, intermediate_size: int,
               artifacts: tuple[str, ...] = ()) -> ModelCard:
    """The card of a checkpoint of `family` (transformers' class `architecture`, such as LlamaForCausalLM) with
    per-layer `plan` and `training` dict."""
    base = training.get("base_model")
    hub_base = base if is_hub_id(base) else None
    license = training.get("license")
    data = ModelCardData(
        # the base model's: its terms hold for the weights trained from it (a custom one by name and link)
        **(license if isinstance(license, dict) else {"license": license}),
        base_model=hub_base,
        base_model_relation="finetune" if hub_base else None,  # its weights, trained further
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=[*TAGS, family],
    )
    means = [layer.mean_active for layer in plan if layer.mean_active is not None]
    overall = (
        f"On held-out text, {sum(means) / len(means):.1f} of {intermediate_size} hidden units are active per "
        f"token on average ({_percent(1 - sum(means) / len(means) / intermediate_size)}% sparsity).\n\n"
        if means else ""
    )
    perplexity = training.get("perplexity") or {}
    if {"original", "after training"} <= set(perplexity):
        overall += (f"Perplexity on that text: {perplexity['original']:.2f} for `{base}`, "
                    f"{perplexity['after training']:.2f} for this model.\n\n")
    plots = "".join(f"![{name}]({name})\n\n" for name in artifacts if name.endswith(".png"))
    body = f"""# {family.capitalize()} with ReLU-gated, activation-sparse MLPs (TwELL)

Converted by sparsify from `{base}`: the MLP gate activation was replaced by ReLU
and training continued with a sparsity penalty on the MLP hidden activations ({objective(training)}),
so that most hidden units are zero for any token. {kernel_summary(plan)}

{overall}## Per-layer sparsity and kernel setting

{layer_table(plan, intermediate_size)}

"dense" layers run the dense path: the plan found no token count at which the sparse kernels gain there (too
many active units, or a layer too narrow for them to pay); `T<tile> C<compression>` is the TwELL tile width
and compression factor chosen from the measured statistics.

{plots}## Training

{training_table(training)}

{loading_section(architecture)}The per-layer plan and statistics are in `config.json` under `"twell"`.

## License

{license_summary(license, base, sorted(name for name in artifacts if is_license_file(name)))}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def name_repo(folder: Path, repo_id: str) -> None:
    """The card of the checkpoint in `folder` loads it from `repo_id` (its code named it WHERE until pushed)."""
    card = folder / "README.md"
    if card.is_file():
        card.write_text(card.read_text().replace(f'"{WHERE}"', f'"{repo_id}"'))
