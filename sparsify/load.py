"""Load the model to convert: the embedded demo, a local checkpoint folder, or a Hub id.

The architecture is checked from the config alone (family table) before any weight is read, so an
unsupported or mistyped model fails in a second, not after a multi-gigabyte download. A Hub id whose config is
not cached is first asked for with a short timeout and no retries, so that a typo or a missing network fails in
seconds, not after transformers' half minute of retries. Every failure the user can fix becomes a
SourceError/UnsupportedModelError naming the source and the problem.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .errors import ConfigError, SourceError
from .families import mlp_modules, spec_for
from .locations import GATED, HUB_TIMEOUT_S, ask_hub, first_line, no_answer, resolve_source


DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA and fp32 elsewhere unless given; accepts torch dtypes and names like 'bf16'."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_config(source: str | Path):
    """(transformers config, family spec) of `source`, reading no weights."""
    return _load_config(resolve_source(source), source)


def _load_config(where: str, source):
    if not Path(where).is_dir():
        check_hub_source(where, source)
    try:
        config = AutoConfig.from_pretrained(where)
    except (OSError, ValueError, KeyError) as error:
        local = Path(where).is_dir()
        what = "cannot read its config.json" if local else "not a local folder, and not loadable from the Hub"
        raise SourceError(f"{source}: {what} ({first_line(error)})") from error
    return config, spec_for(config)


def check_hub_source(repo_id: str, source) -> None:
    """SourceError, within HUB_TIMEOUT_S, where the Hub model `repo_id` cannot be read: no such repository (a typo,
    or a private one without a token), a gated one, no config.json, or no connection or answer (no network). Asks
    nothing where its config.json is in the local cache (transformers then reads the cache at once) or offline mode
    is on (then a model the cache lacks is said so).
    `repo_id` comes from resolve_source, which has refused an id the Hub cannot hold."""
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if constants.is_offline_mode():
        raise SourceError(f"{source}: not a local folder, and offline (HF_HUB_OFFLINE=1) the Hugging Face cache holds "
                          f"no copy of it: download it first (`hf download {repo_id} --local-dir DIR`) and give DIR, "
                          "or give a local folder")
    failure = ask_hub(lambda: get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=HUB_TIMEOUT_S))
    if failure is None:
        return
    kind, error = failure
    raise SourceError(f"{source}: " + {
        "gated": GATED.format("model"),
        "not found": "no such model on the Hub (check the id; a private one needs `hf auth login`)",
        "no file": "the Hub repository has no config.json, so it is no transformers model",
        "refused": f"the Hub did not give its config.json ({first_line(error)})",
        "no answer": f"not a local folder, and {no_answer(error, HUB_TIMEOUT_S)} ({first_line(error)}); offline, "
                     "HF_HUB_OFFLINE=1 reads models cached before",
    }[kind])


def require_cuda(device, what: str, instead: str = "") -> torch.device:
    """The CUDA device to run on; ConfigError naming `what` (and `instead`, what a CPU can do) when there is none."""
    if device is not None and torch.device(device).type != "cuda":
        raise ConfigError(f"{what} needs a CUDA GPU, not --device {device}" + instead)
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"{what} needs a CUDA GPU, and torch ({torch.__version__}, {build}) sees none" + instead)
    return torch.device(device or "cuda")


def check_device(device: str | None) -> None:
    """ConfigError for a --device this machine cannot run on (a CUDA device without CUDA, or no such device)."""
    if device is None:
        return
    try:
        where = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device}: not a device (use cpu, cuda or cuda:N)") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch {torch.__version__}, no GPU visible"
        raise ConfigError(f"--device {device}: no CUDA GPU here ({build}); use --device cpu or leave it out")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")


def load_model(source: str | Path, *, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
               weights: bool = True, config=None, tokenizer=None):
    """(model, tokenizer or None, spec) for "demo", a checkpoint folder or a Hub id; the model in eval mode
    on `device` (default: CUDA if available). The tokenizer is None when the source has none that loads.
    weights=False builds the model from the config with its parameters uninitialized in CPU memory
    (torch.empty: no pages are used until written) and reads no weight file: for the processes of an FSDP
    run that receive their shards from the main process. `config` and `tokenizer`: the source's, where the caller
    has read them (load_config, load_tokenizer), which are then not asked for again."""
    where = resolve_source(source)
    config, spec = _load_config(where, source) if config is None else (config, spec_for(config))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if weights:
        check_weight_files(where, source)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                where, config=config, dtype=resolve_dtype(dtype, device), output_loading_info=True
            )
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise SourceError(f"{source}: cannot load the weights ({first_line(error)})") from error
        if info["missing_keys"] or info["mismatched_keys"]:
            missing = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
            raise SourceError(f"{source}: the weights do not match the config (missing or mismatched: "
                              f"{missing[:5]} ...)")
        model = model.to(device).eval()
    else:
        model = _unloaded_model(config, resolve_dtype(dtype, torch.device("cpu")))
    return model, load_tokenizer(where) if tokenizer is None else tokenizer, spec


def check_weight_files(where: str, source) -> None:
    """SourceError naming a safetensors file of the folder `where` that is shorter than its header says (a download
    or copy cut short), or whose header does not read, from the headers alone: safetensors says so only once a load
    reaches the file, and a dry run reads no weight. A Hub id: nothing (its download checks what it fetches)."""
    if not Path(where).is_dir():
        return
    for path in sorted(Path(where).glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as file:  # 8 bytes of header length (little-endian), the JSON header, the data
            length = int.from_bytes(file.read(8), "little")
            header = file.read(length) if 8 + length <= size else b""
        try:
            end = max((entry["data_offsets"][1] for name, entry in json.loads(header).items()
                       if name != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise SourceError(f"{source}: cannot load the weights: {path.name}: no safetensors header (cut short, or "
                              "not a weight file; download it again)") from None
        if size < 8 + length + end:
            raise SourceError(f"{source}: cannot load the weights: {path.name}: truncated ({size:,} of "
                              f"{8 + length + end:,} bytes; download it again)")


def parameter_count(config) -> int:
    """Parameters of the family model of `config` (tied ones once), counted on the meta device: no memory."""
    return sum(p.numel() for p in _meta_model(config).parameters())


def mlp_parameter_count(config) -> int:
    """Parameters of the family MLPs of `config`'s model (the projections conversion trains), counted on the meta
    device."""
    model = _meta_model(config)
    return sum(p.numel() for mlp in mlp_modules(model, spec_for(config)) for p in mlp.parameters())


def _unloaded_model(config, dtype: torch.dtype):
    """The family model of `config` with uninitialized CPU parameters (each its own storage, as FSDP's
    preparation maps parameters by address) and computed buffers (rotary tables), weights tied."""
    model = _meta_model(config, dtype, buffers=False)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                              requires_grad=param.requires_grad)
    model.tie_weights()
    return model.eval()


def _meta_model(config, dtype: torch.dtype | None = None, buffers: bool = True):
    """The family model of `config` with its parameters (and with `buffers` its buffers) on the meta
    device, weights tied."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=buffers):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


# transformers 5 builds an empty tokenizer of the family's class from a folder without any of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(where: str):
    """The source's tokenizer, or None when it has none."""
    if Path(where).is_dir() and not any((Path(where) / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def require_tokenizer(tokenizer, source, config=None) -> None:
    """Stop with a clear message where a tokenizer is needed (tokenizing text) and the source has none, or (with the
    model's `config`) where its ids reach beyond the model's embeddings: a tokenizer of another model, which would
    fail at the first forward with an index error. Its added tokens (a pad token added without resizing the
    embeddings) are left out: text does not hold them."""
    if tokenizer is None:
        raise SourceError(f"{source}: no tokenizer could be loaded from it (tokenizer.json / tokenizer_config.json)")
    embeddings = getattr(config, "vocab_size", None)
    if embeddings is None:
        return
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    for what, size in (("its vocabulary", getattr(tokenizer, "vocab_size", None)),
                       ("the EOS/BOS id that separates documents", None if separator is None else separator + 1)):
        if size is not None and size > embeddings:
            raise SourceError(f"{source}: the tokenizer does not fit the model: {what} reaches id {size - 1:,}, and "
                              f"the model has {embeddings:,} token embeddings (config.json's vocab_size); give the "
                              f"model's own tokenizer")
