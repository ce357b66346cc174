"""The training state on disk, from which an interrupted run continues: accelerate's save_state (weights,
optimizer, scheduler, RNG) plus state.json (where the run stands, its settings, processes and inputs),
last_fired.pt and data_position.pt (where the data stream stands), in a folder (convert: OUT.resume/)."""
from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path

import torch
from accelerate import Accelerator

from .config import RunOptions, TrainConfig, option_name
from .errors import ConfigError
from .locations import holds_state, no_saved_state, saved_state, staging_dir

# Settings a resumed run may change: they touch no saved state (log and save cadence; fused_decoder, the kernels
# that compute the norms and rotary, and chunked_loss, how the LM head and the loss are computed, differ only in
# rounding). eval_tokens may not: where the held-out blocks are the head of the training text, it moves where
# training starts.
RESUME_FREE = ("log_every", "save_every", "save_every_minutes", "fused_decoder", "chunked_loss")
# The saved settings and inputs that are command-line options (cli.py makes one of each of these fields): messages
# name them by the option, as typed; any other by its name in the recipe or state.json (the source: an argument).
OPTIONS = frozenset(setting.name for settings in (TrainConfig, RunOptions) for setting in fields(settings))
# what every save writes into state.json (train.saving.Saver.save, and the settings)
SAVED_KEYS = ("step", "batches", "log", "seconds", "l1_reference", "l1_scale", "l1_eps", "processes", "inputs",
              "before_training", "run_name", "config")


def recover_killed_save(resume_dir) -> bool:
    """Where a save was killed after its staging folder was whole (state.json is written last) but before it
    replaced `resume_dir` (removed, or partly removed), the staging folder becomes the saved state. Returns
    whether it did. Main process only, before the others look at the state."""
    staging = staging_dir(resume_dir)
    if saved_state(resume_dir) != staging:
        return False
    shutil.rmtree(resume_dir, ignore_errors=True)
    staging.rename(resume_dir)
    return True


def discard_saved_state(resume_dir) -> None:
    """Removes the saved training state and whatever a save killed midway left beside it."""
    for folder in (resume_dir, staging_dir(resume_dir)):
        shutil.rmtree(folder, ignore_errors=True)


def _not_the_tied_weights_note(record: logging.LogRecord) -> bool:
    """False for accelerate's "Removed shared tensor ... while saving", which it logs at every save of a model
    with tied weights (embeddings and lm_head: the demo's, Qwen2.5's): the tied weight is stored once and the
    resumed model, built from the same config, ties it again, so there is nothing to check."""
    return "Removed shared tensor" not in record.getMessage()


@contextmanager
def _without_tied_weights_note():
    logger = logging.getLogger("accelerate.utils.other")  # its other warnings still show
    logger.addFilter(_not_the_tied_weights_note)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_tied_weights_note)


def save_state(accelerator: Accelerator, resume_dir, state: dict, last_fired: torch.Tensor | None,
               config: TrainConfig, data_position: dict | None) -> None:
    """Saves the training state (collective: every process calls it): `state` (JSON values) into state.json
    with the `config`, the units' `last_fired` token counts and the data stream's `data_position` (its
    state_dict; None for a stream without one)."""
    # Written beside and renamed into place: a process killed while saving (a launcher's shutdown timeout)
    # leaves the previous state, never a half-written one.
    # Every process writes its part (its RNG state; under FSDP its shards): the main one alone clears the
    # folder before and renames it after all are done.
    resume_dir = Path(resume_dir)
    tmp = staging_dir(resume_dir)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        with _without_tied_weights_note():
            accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            torch.save(last_fired, tmp / "last_fired.pt")
            torch.save(data_position, tmp / "data_position.pt")
            (tmp / "state.json").write_text(json.dumps({**state, "config": asdict(config)}, indent=1))
    except Exception:  # a disk that filled up: no partial save left behind (a whole one holds state.json)
        if accelerator.is_main_process and not (tmp / "state.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        shutil.rmtree(resume_dir, ignore_errors=True)
        tmp.rename(resume_dir)
    accelerator.wait_for_everyone()


def saved_run_name(resume_dir) -> str | None:
    """The tracker run name saved with the state in `resume_dir` (None: no state)."""
    if resume_dir is None or not holds_state(resume_dir):
        return None
    return json.loads((Path(resume_dir) / "state.json").read_text()).get("run_name")


def load_last_fired(resume_dir, device) -> torch.Tensor | None:
    """The units' last-firing token counts saved with the state in `resume_dir`, on `device`."""
    fired = torch.load(Path(resume_dir) / "last_fired.pt")
    return None if fired is None else fired.to(device)


def load_data_position(resume_dir) -> dict | None:
    """The data stream's position saved with the state in `resume_dir` (None: the stream had none, and skips the
    consumed batches by reading them)."""
    return torch.load(Path(resume_dir) / "data_position.pt")


def check_resume(resume_dir, config: TrainConfig, processes: int, inputs: dict | None = None) -> dict:
    """The saved state (state.json) of `resume_dir`, after checking that this run continues it: the training
    settings it was saved with (but RESUME_FREE: another batch size, schedule or L1 would make a run that is
    neither), as many processes (under FSDP each holds its shards; the batches per step depend on it) and
    the same `inputs` (see train.train). ConfigError naming what differs otherwise."""
    if resume_dir is None or not holds_state(resume_dir):
        raise ConfigError(no_saved_state(resume_dir))
    path = Path(resume_dir) / "state.json"
    state = json.loads(path.read_text())
    missing = [key for key in SAVED_KEYS if key not in state] + [
        name for name in ("last_fired.pt", "data_position.pt") if not (path.parent / name).is_file()]
    if missing:
        raise ConfigError(f"--resume: the state in {resume_dir} lacks {', '.join(missing)} (saved by another "
                          "version of sparsify, or edited): start over with --overwrite instead of --resume")

    def differences(saved: dict | None, current: dict) -> str:
        current = json.loads(json.dumps(current))  # as state.json holds it (tuples as lists)
        return "; ".join(f"{option_name(name) if name in OPTIONS else name} {saved[name]!r} -> {value!r}"
                         for name, value in current.items()
                         if name in (saved or {}) and name not in RESUME_FREE and saved[name] != value)

    for what, key, current in (("with other training settings", "config", asdict(config)),
                               ("by a run on other inputs", "inputs", inputs or {})):
        changed = differences(state.get(key), current)
        if changed:
            raise ConfigError(f"--resume: the state in {resume_dir} was saved {what} ({changed}); resume with the "
                              "same, or start over with --overwrite instead of --resume")
    saved_processes = state["processes"]
    if saved_processes != processes:
        raise ConfigError(f"--resume: the state in {resume_dir} was saved by {saved_processes} processes and this "
                          f"run has {processes}: launch {saved_processes}")
    return state
