"""Where a command reads and writes: the model source (the demo, a checkpoint folder or a Hub id), the demo's
files, the data (local files or a `datasets` name), the output folder and the training state beside it. Imports no
torch or transformers, so that the CLI checks these paths before it imports the modules that load models: a mistyped
path fails at once."""
from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import LAUNCHER_GRACE_S
from .errors import ConfigError, DataError, OutputError, SourceError, UnsupportedModelError

# The model_types of families.FAMILIES, here without torch, so that the CLI tells a supported source from its
# config.json before importing it (tests/test_families.py checks that the two agree).
FAMILY_NAMES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"})
# Config attributes that mark a mixture-of-experts model: its MLPs are routed experts, not one gated block.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

DATA_REQUIRED = "--data is required (local .txt/.json/.jsonl/.parquet files or folder, or a datasets name)"
HUB_TIMEOUT_S = 5  # how long the Hub may take to answer whether a model source or a dataset exists (one request)
GATED = "a gated {} on the Hub: accept its terms on its page and log in (`hf auth login`)"
SAMPLE_DATA_REQUIRED = ("--data is required: the text whose training blocks give the prompts and whose held-out text "
                        "the folder keeps")

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EVAL_PREFIXES = ("valid", "eval", "test")  # valid* covers validation*


def demo_model_path() -> Path:
    """The embedded small SiLU Llama (made by recipes/make_demo.py)."""
    return Path(__file__).parent / "demo" / "model"


def demo_corpus_path() -> Path:
    """The embedded demo corpus folder (train.jsonl, valid.jsonl)."""
    return Path(__file__).parent / "demo" / "corpus"


def resolve_source(source: str | Path) -> str:
    """A local folder path or a Hub id for `source`; SourceError for a folder that cannot be a checkpoint."""
    if str(source) == "demo":
        path = demo_model_path()
        if not (path / "config.json").is_file():
            raise SourceError(f"the demo model is missing at {path}; remake it with recipes/make_demo.py")
        return str(path)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{source}: not a folder (expected a checkpoint folder with config.json)")
        if not (path / "config.json").is_file():
            raise SourceError(f"{source}: no config.json in this folder, so it is not a model checkpoint")
        return str(path)
    # Hub ids are "name" or "owner/name"; anything else that does not exist is a mistyped path.
    if str(source).startswith((".", "/", "~")) or str(source).endswith("/") or str(source).count("/") > 1 or \
            "\\" in str(source):
        raise SourceError(f"{source}: no such folder")
    if problem := hub_id_problem(str(source)):  # now, not after importing torch
        raise SourceError(f"{source}: not a local folder, and not a Hub model id ({problem})")
    return str(source)


def family_problem(setting) -> str | None:
    """Why a model whose config gives `setting(name)` (a value or None) is not of a family in FAMILY_NAMES, or
    None: the message of families.spec_for and of the CLI's check before torch."""
    model_type = setting("model_type")
    if model_type in FAMILY_NAMES:
        return None
    kind = ("a mixture-of-experts model" if any(setting(key) for key in MOE_KEYS)
            else "not a gated-MLP architecture that sparsify knows")
    return f"model_type {model_type!r} is {kind}; supported families: {', '.join(sorted(FAMILY_NAMES))}"


def family_config(where: str) -> dict | None:
    """The config.json of `where` (resolve_source's: a folder, or a Hub id, read from the local cache without asking
    the Hub) where it names a family in FAMILY_NAMES; UnsupportedModelError where it names another model_type; None
    where it names none, is not at hand or does not read (the library then says why)."""
    config = Path(where) / "config.json"
    if not Path(where).is_dir():
        from huggingface_hub import try_to_load_from_cache  # no torch, no request

        cached = try_to_load_from_cache(where, "config.json")
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        return None
    problem = family_problem(values.get)
    if problem:
        raise UnsupportedModelError(problem)
    return values


def hub_id_problem(repo_id: str) -> str | None:
    """Why the Hub cannot hold a repository named `repo_id` (huggingface_hub's first line), or None."""
    from huggingface_hub.errors import HFValidationError  # imports no torch
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return str(error).splitlines()[0]
    return None


def check_hub_repo(repo_id: str) -> None:
    """OutputError where `repo_id` (--push-to-hub) is no id the Hub can hold, or no Hub token is at hand to push
    with: said before training, not after it."""
    if problem := hub_id_problem(repo_id):
        raise OutputError(f"--push-to-hub {repo_id}: not a Hub repository id ({problem})")
    from huggingface_hub import constants, get_token  # HF_TOKEN, else the file `hf auth login` writes

    if constants.is_offline_mode():  # the upload would fail only after the whole run
        raise OutputError(f"--push-to-hub {repo_id}: offline (HF_HUB_OFFLINE=1) nothing can be uploaded; unset it, "
                          "or convert without --push-to-hub and upload OUT later with `hf upload`")
    if get_token() is None:
        raise OutputError(f"--push-to-hub {repo_id}: not logged in to the Hub: run `hf auth login`, or set HF_TOKEN "
                          "to a token with write access")


def check_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """OUT as a Path; OutputError if it is a file, a non-empty folder and `overwrite` is False, or cannot be
    written (checked before a conversion trains: the nearest existing folder above it must be writable)."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    above = out.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"{out}: cannot be written, {above} is a file")
    try:  # the checkpoint is staged beside OUT and renamed into place: a folder made there and removed, since
        # os.access says yes to root everywhere (a read-only mount, /proc) and a run would train, then fail to write
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", dir=above))
    except OSError as error:
        raise OutputError(f"{out}: cannot be written, {above} is not writable ({error.strerror or error})") from None
    return out


@dataclass
class DataSource:
    """Where the documents come from: local files grouped by builder, or a Hub dataset name."""

    train: dict[str, list[str]] | str
    eval: dict[str, list[str]] | str | None  # None: hold out the first training blocks

    @property
    def description(self) -> str:
        return self.description_of(self.train)

    @staticmethod
    def description_of(files: dict[str, list[str]] | str) -> str:
        return files if isinstance(files, str) else ", ".join(sum(files.values(), []))


def resolve_data(spec: str | Path) -> DataSource:
    """`--data` value -> DataSource. A path that exists is local; anything else must look like a Hub
    dataset name ("owner/name" or "name"), else the path is reported missing."""
    path = Path(spec).expanduser()
    if not path.exists():
        parts = Path(hub_arguments(str(spec))[0]).parts
        if (str(spec).startswith((".", "/", "~")) or str(spec).endswith("/") or Path(spec).suffix in FORMATS
                or len(parts) > 1 and Path(parts[0]).is_dir()):  # a path, mistyped: no Hub lookup
            raise DataError(f"data path {spec} does not exist")
        return DataSource(train=str(spec), eval=None)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if not p.name.startswith(".")]
    if not files:
        raise DataError(f"data folder {path} is empty")
    unknown = [p.name for p in files if p.suffix.lower() not in FORMATS]
    if (unknown and path.is_file()) or len(unknown) == len(files):
        raise DataError(
            f"unknown data format: {', '.join(unknown[:5])} (use {', '.join(FORMATS)} files or a folder of them)"
        )
    files = [p for p in files if p.suffix.lower() in FORMATS]
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"data {path} is empty")
    held_out = [p for p in files if path.is_dir() and p.stem.lower().startswith(EVAL_PREFIXES)]
    train = [p for p in files if p not in held_out]
    if not train:
        raise DataError(f"data {path} has only evaluation files ({', '.join(p.name for p in held_out)})")
    return DataSource(train=_by_builder(train), eval=_by_builder(held_out) if held_out else None)


def check_data(spec: str | Path, passes: float | None = None) -> DataSource:
    """resolve_data's DataSource of --data `spec` (DataError for a path that is not there or holds no text), and
    for a `datasets` name: ConfigError where `passes` would count it (it is streamed), else check_hub_dataset."""
    source = resolve_data(spec)
    if isinstance(source.train, str):
        if passes is not None:
            raise ConfigError(f"--passes counts the training text, and --data {spec} is a `datasets` name, streamed "
                              "rather than counted: it needs local text; give --tokens instead")
        check_hub_dataset(str(spec))
    return source


@functools.cache  # once a run: the CLI checks before torch, the library again
def check_hub_dataset(spec: str) -> None:
    """DataError, within HUB_TIMEOUT_S, where --data `spec`, which names no local path (resolve_data took it for a
    `datasets` name), names no dataset the Hub holds, or the Hub cannot be asked and its files are not cached: one
    request, no retries (datasets would retry for half a minute, then not say that no such local path exists).
    Offline, asks nothing: DataError where datasets' cache holds no copy of it either."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache  # no torch

    name, config, _ = hub_arguments(spec)
    if constants.is_offline_mode():
        if not _in_datasets_cache(name, config):
            raise DataError(f"--data {spec}: no local file or folder of that name, and offline (HF_HUB_OFFLINE=1) the "
                            "datasets cache holds no copy of it: download the dataset first (`hf download "
                            f"{name} --repo-type dataset --local-dir DIR`) and give --data DIR, or give --data a local "
                            "file or folder")
        return
    failure = ask_hub(lambda: HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S))
    if failure is None:
        return
    kind, error = failure
    if kind == "no answer" and isinstance(try_to_load_from_cache(name, "README.md", repo_type="dataset"), str):
        return  # cached before: datasets may read it from the cache
    where = f"--data {spec}: no local file or folder of that name, and"
    # any other kind is "refused", another HTTP error ("no file" answers a request for a file: this asks for none)
    raise DataError({
        "gated": f"--data {spec}: {GATED.format('dataset')}",
        "not found": f"{where} no dataset {name} on the Hub (check the name; a private one needs `hf auth login`)",
        "no answer": f"{where} {no_answer(error, HUB_TIMEOUT_S)} to find it as a dataset ({first_line(error)}); "
                     "offline, HF_HUB_OFFLINE=1 reads datasets cached before",
    }.get(kind, f"{where} the Hub did not give dataset {name} ({first_line(error)})"))


def _in_datasets_cache(name: str, config: str | None) -> bool:
    """Whether datasets loads dataset `name` (`config`) offline, from a copy in its own cache: its own lookup, which
    imports no torch."""
    try:
        import datasets
    except ImportError:
        return False
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # its warning that it reads the cache, for this lookup only
    try:
        datasets.load_dataset_builder(name, config)
    except Exception:  # not in the cache (datasets says so in several kinds)
        return False
    finally:
        datasets.logging.set_verbosity(verbosity)
    return True


def ask_hub(request) -> tuple[str, BaseException] | None:
    """None where the Hub answered `request` (one call, which sets its own timeout), else what went wrong and the
    error: "gated", "not found" (no such repository, or a private one without a token), "no file" (the repository
    has not the file asked for), "refused" (another HTTP error) or "no answer" (no response)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError)

    try:
        request()
    except GatedRepoError as error:  # a RepositoryNotFoundError: asked first
        return "gated", error
    except RepositoryNotFoundError as error:
        return "not found", error
    except RemoteEntryNotFoundError as error:
        return "no file", error
    except HfHubHTTPError as error:
        return "refused", error
    except Exception as error:  # no response: the HTTP client's connection and timeout errors
        return "no answer", error
    return None


def no_answer(error: BaseException, timeout: float) -> str:
    """What a request to the Hub that got no response met, in words. Told apart by class name: the HTTP client
    under huggingface_hub (requests, httpx or httpx2, by its version) names its timeouts *Timeout*, its refused
    connections and failed name lookups otherwise."""
    timed_out = any("Timeout" in kind.__name__ for kind in type(error).__mro__)
    return f"the Hub did not answer within {timeout:g} s" if timed_out else "could not reach the Hub"


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def hub_arguments(spec: str) -> tuple[str, str | None, str]:
    """(name, config, split) of a Hub dataset given as NAME[:CONFIG][@SPLIT], e.g. allenai/c4:en@validation
    (split default: train)."""
    name_config, _, split = spec.partition("@")
    name, _, config = name_config.partition(":")
    return name, config or None, split or "train"


def _by_builder(files: list[Path]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for p in files:
        groups.setdefault(FORMATS[p.suffix.lower()], []).append(str(p))
    return groups


def _beside(out: str | Path, suffix: str) -> Path:
    out = Path(out).expanduser().resolve()
    return out.with_name(out.name + suffix)


def resume_dir_for(out: str | Path) -> Path:
    """Where a conversion to `out` keeps its training state (OUT.resume/: beside it, never taken for a checkpoint)."""
    return _beside(out, ".resume")


def logging_dir_for(out: str | Path) -> Path:
    """Where the trackers of --report-to that write files (tensorboard) write them: beside OUT, not in the
    checkpoint."""
    return _beside(out, ".logs")


def staging_dir(resume_dir) -> Path:
    """Where a save is written before it replaces `resume_dir`: what a process killed while saving leaves."""
    resume_dir = Path(resume_dir)
    return resume_dir.with_name(resume_dir.name + ".tmp")


def saved_state(resume_dir) -> Path | None:
    """The folder of the training state that --resume continues in `resume_dir`: the staging folder of a save killed
    after it was whole (state.json is written last) but before it replaced `resume_dir`, which
    resume.recover_killed_save puts in place; else `resume_dir` where a save completed; else None. The staging
    folder is looked at first, so that one renamed into place between the two looks is found all the same."""
    for folder in (staging_dir(resume_dir), Path(resume_dir)):
        if holds_state(folder):
            return folder
    return None


def holds_state(folder) -> bool:
    """Whether `folder` holds a whole saved training state: a save writes its state.json last."""
    return (Path(folder) / "state.json").is_file()


def no_saved_state(resume_dir) -> str:
    """--resume's message where `resume_dir` holds no state to resume from: said by the CLI before torch is imported
    (saved_state: None) and by resume.check_resume after a killed save's recovery."""
    staging = staging_dir(resume_dir) if resume_dir is not None else None
    return f"--resume: no saved training state in {resume_dir}" + (
        f" ({staging} holds a save that was killed before it finished, which cannot be resumed from: a "
        f"launcher kills its processes {LAUNCHER_GRACE_S} s after a Ctrl-C; see --save-every)"
        if staging is not None and staging.is_dir() else "")
