"""twell: TwELL sparse-activation kernels (Triton) for ReLU MLPs. Depends on torch and triton only."""
from .format import TwELL, pack, pack_reference, slots, unpack
from .gated_mlp import gated_mlp, gated_mlp_reference, prepare_down
from .graphs import DecodeGraphs
from .hybrid import HybridStats, hot_units, hybrid_gated_mlp, hybrid_mlp
from .layer_plan import LayerPlan, Mode, layer_plans
from .mlp import mlp, mlp_reference

__all__ = ["TwELL", "pack", "pack_reference", "unpack", "slots", "gated_mlp",
           "gated_mlp_reference", "prepare_down", "DecodeGraphs", "mlp", "mlp_reference", "HybridStats",
           "hot_units", "hybrid_gated_mlp", "hybrid_mlp", "LayerPlan", "Mode", "layer_plans"]
