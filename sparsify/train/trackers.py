"""The accelerate trackers of --report-to (tensorboard, wandb, ...): their names checked, a folder per run, and
a log entry's figures as they take them."""
from __future__ import annotations

import time
from pathlib import Path

from ..errors import ConfigError, MissingDependencyError


def new_run_name(logging_dir: str | Path | None) -> str:
    """A fresh run's folder name under logging_dir: its start time (UTC), with a count where that is taken, so
    that a second run into the same OUT does not append to the first one's curves."""
    name = candidate = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    count = 1
    while logging_dir and (Path(logging_dir) / candidate).exists():
        count += 1
        candidate = f"{name}-{count}"
    return candidate


def trackers(report_to: str) -> list[str]:
    """The accelerate trackers that --report-to names, comma-separated ("all": those installed; "none": no
    tracker). ConfigError for a name accelerate does not know, MissingDependencyError for a tracker whose
    package is not installed."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    from accelerate.utils import LoggerType

    names = [name.strip() for name in report_to.split(",") if name.strip() not in ("", "none")]
    known = ["all", *LOGGER_TYPE_TO_CLASS]  # the built-in trackers and those registered with accelerate
    installed = {tracker.value for tracker in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"--report-to {name}: not a tracker; use none, or one or more of {', '.join(known)} "
                              "separated by commas")
        if name in {kind.value for kind in LoggerType} - {"all"} and name not in installed:
            raise MissingDependencyError(f"--report-to {name}: the {name} package is not installed "
                                         f"(pip install {name})")
    return names


def tracker_values(entry: dict) -> dict:
    """A log entry as trackers take it: its figures, each layer's under layers/INDEX/ (its path as `hybrid`, 1 or
    0), the step aside."""
    values = {name: value for name, value in entry.items() if name not in ("step", "layers")}
    for index, layer in enumerate(entry["layers"]):
        values.update({f"layers/{index}/{name}": value for name, value in layer.items() if name != "path"})
        values[f"layers/{index}/hybrid"] = int(layer["path"] == "hybrid")
    return values
