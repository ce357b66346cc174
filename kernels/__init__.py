"""twell: TwELL sparse-activation kernels (Triton) for ReLU MLPs: the inference runtime that converted
checkpoints carry (docs/design.md lists its files) and the hybrid training kernels (hybrid.py).
Depends on torch and triton only."""
from .format import TwELL, pack, pack_reference, slots, unpack
from .gated_mlp import gated_mlp, prepare_down
from .graphs import DecodeGraphs
from .hybrid import HybridStats, hot_units, hybrid_gated_mlp
from .layer_plan import LayerPlan, Mode, layer_plans
from .reference import gated_mlp_reference
from .rms_norm import rms_norm, rms_norm_reference
from .rotary import rotary, rotary_reference

__all__ = ["TwELL", "pack", "pack_reference", "unpack", "slots", "gated_mlp", "gated_mlp_reference", "prepare_down",
           "DecodeGraphs", "HybridStats", "hot_units", "hybrid_gated_mlp", "LayerPlan", "Mode", "layer_plans", "rms_norm",
           "rms_norm_reference", "rotary", "rotary_reference"]
