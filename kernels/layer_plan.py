"""A decoder layer's kernel plan: the contract between the sparsify toolkit, which writes it into config.json's
"twell" section, and the modeling file, which runs it.

Format version 1 (a section without "format_version" reads as 1):
    "twell": {"format_version": 1, ..., "layers": [entry, ...]}
    entry: {"mode": "sparse", "tile": 128, "compression": 8, "sparse_tokens": [[1, 64], [700, null]],
            "stats": {"mean_active": 27.1, ...}}  or  {"mode": "dense", "stats": {...}}
A sparse entry without "sparse_tokens" runs at every token count;
an entry without "mode" is dense.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .format import slots

FORMAT_VERSION = 1
ALL_TOKENS = ((1, None),)


class Mode(str, Enum):
    SPARSE = "sparse"  # the TwELL kernels, at the token counts of sparse_tokens
    DENSE = "dense"  # the dense ReLU block at every token count


def _windows(ranges) -> tuple[tuple[int, int | None], ...]:
    """(lo, hi) pairs of [lo, hi] token ranges; ValueError unless 1 <= lo <= hi (hi None: no bound)."""
    def valid(bounds):
        return (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and isinstance(bounds[0], int)
                and bounds[0] >= 1 and (bounds[1] is None or isinstance(bounds[1], int) and bounds[1] >= bounds[0]))

    if not isinstance(ranges, (list, tuple)) or not all(valid(bounds) for bounds in ranges):
        raise ValueError(f"config.twell: sparse_tokens must be [lo, hi] ranges (1 <= lo <= hi, hi null "
                         f"for no bound), got {ranges!r}")
    return tuple((lo, hi) for lo, hi in ranges)


@dataclass(frozen=True)
class LayerPlan:
    """How a layer's MLP runs: `mode`; for sparse, the kernels' `tile` and `compression` and the token-count
    windows `sparse_tokens` ((lo, hi) pairs, hi None: unbounded) where they run; `stats`, what the planner
    measured (mean_active, p99_active, dead_frac, predicted or measured speed-ups, ...: free-form)."""

    mode: Mode = Mode.DENSE
    tile: int | None = None
    compression: int | None = None
    sparse_tokens: tuple[tuple[int, int | None], ...] = ALL_TOKENS  # as an entry without "sparse_tokens"
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ValueError(f"config.twell: mode must be 'sparse' or 'dense', got {self.mode!r}") from None
        object.__setattr__(self, "sparse_tokens", _windows(self.sparse_tokens))
        if self.mode is Mode.SPARSE:
            if not isinstance(self.tile, int) or not isinstance(self.compression, int):
                raise ValueError(f"config.twell: a sparse layer needs an int tile and compression, got tile "
                                 f"{self.tile!r}, compression {self.compression!r}")
            slots(self.tile, self.compression)  # ValueError for a tile or compression the kernels do not take

    @property
    def is_sparse(self) -> bool:
        return self.mode is Mode.SPARSE

    @property
    def mean_active(self) -> float | None:
        """Mean active units per token where the planner measured it."""
        return self.stats.get("mean_active")

    def to_json(self) -> dict:
        """The config.twell "layers" entry."""
        entry = {"mode": self.mode.value}
        if self.is_sparse:
            entry.update(tile=self.tile, compression=self.compression,
                         sparse_tokens=[list(window) for window in self.sparse_tokens])
        return entry | {"stats": dict(self.stats)}

    @classmethod
    def from_json(cls, entry: dict) -> LayerPlan:
        """The plan of a config.twell "layers" entry (format version 1, defaults as the module docstring says)."""
        mode = entry.get("mode", Mode.DENSE)
        stats = dict(entry.get("stats", {}))
        if mode == Mode.DENSE:  # tile, compression and windows mean nothing for a dense layer
            return cls(stats=stats)
        return cls(mode, entry.get("tile"), entry.get("compression"), entry.get("sparse_tokens", ALL_TOKENS), stats)


def layer_plans(twell: dict) -> list[LayerPlan]:
    """The layer plans of a config.json "twell" section; ValueError for a format version this runtime cannot read
    or a section without its "layers" list."""
    version = twell.get("format_version", 1)
    if version != FORMAT_VERSION:
        raise ValueError(f"config.twell: format_version {version!r}, but this runtime reads only version "
                         f"{FORMAT_VERSION} (a newer sparsify may have written it)")
    if not isinstance(twell.get("layers"), list):
        raise ValueError("config.twell: no \"layers\" list (one entry a decoder layer)")
    return [LayerPlan.from_json(entry) for entry in twell["layers"]]
