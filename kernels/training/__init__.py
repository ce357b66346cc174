"""The hybrid TwELL training kernels (hybrid.py; ell.py and backup.py hold the kernels, reference.py their
reference, penalty.py the sparsity penalty they compute), `pack` (pack.py: the TwELL of a dense activation,
which no runtime path runs) and the trainer's chunked LM head and loss (head_loss.py). Not run by a converted
model: a checkpoint carries the runtime at the package's top level, never this folder."""
from .hybrid import HOT_RATE, hot_units, hybrid_gated_mlp
from .pack import pack
from .penalty import sparsity_penalty
from .reference import HybridStats, hybrid_gated_mlp_reference

__all__ = ["HOT_RATE", "HybridStats", "hot_units", "hybrid_gated_mlp", "hybrid_gated_mlp_reference", "pack",
           "sparsity_penalty"]
