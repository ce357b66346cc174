"""twell: TwELL sparse-activation kernels (Triton) for ReLU MLPs. The files at this level are the inference
runtime that converted checkpoints carry, flat beside their modeling file (docs/design.md lists them); the
training/ sub-package holds the hybrid training kernels, which no checkpoint carries. Every kernel's plain
PyTorch reference is in the reference.py of its level. Depends on torch and triton only."""
from .cache_write import cache_write
from .decode_attention import decode_attention
from .format import TwELL, slots, unpack
from .gated_mlp import gated_mlp, prepare_down
from .graphs import DecodeGraphs
from .layer_plan import LayerPlan, Mode, layer_plans
from .reference import (cache_write_reference, decode_attention_reference, gated_mlp_reference, pack_reference,
                        rms_norm_add_reference, rms_norm_reference, rotary_reference, small_linear_reference)
from .rms_norm import rms_norm, rms_norm_add
from .rotary import rotary
from .small_linear import small_linear, small_linear_grouped
from .training import HybridStats, hot_units, hybrid_gated_mlp, pack

__all__ = ["TwELL", "pack", "pack_reference", "unpack", "slots", "gated_mlp", "gated_mlp_reference", "prepare_down",
           "DecodeGraphs", "HybridStats", "hot_units", "hybrid_gated_mlp", "LayerPlan", "Mode", "layer_plans",
           "rms_norm", "rms_norm_reference", "rms_norm_add", "rms_norm_add_reference", "rotary", "rotary_reference",
           "small_linear", "small_linear_grouped", "small_linear_reference", "decode_attention",
           "decode_attention_reference", "cache_write", "cache_write_reference"]
