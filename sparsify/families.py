"""Per-architecture table of gated feed-forward blocks, keyed by the Hugging Face `model_type`.

Each entry says where the decoder layers and their MLPs are, what the projections are called (separate
gate/up, or one fused `gate_up_proj` with the gate in the first half as in Phi-3) and which config key
holds the gate activation. Everything downstream (relufy, measure, export, the checkpoint's modeling
file) goes through this table instead of branching on the architecture; adding a family is one entry.
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .errors import UnsupportedModelError
from .locations import family_problem


@dataclass(frozen=True)
class FamilySpec:
    """Where a family keeps its gated MLPs and how they are wired."""

    family: str = field(metadata={"help": "HF `model_type` of the family, e.g. 'llama'."})
    causal_lm: str = field(
        metadata={"help": "Import path of the transformers CausalLM class that exported checkpoints subclass."}
    )
    layers: str = field(default="model.layers", metadata={"help": "Path of the decoder-layer list from the CausalLM."})
    mlp: str = field(default="mlp", metadata={"help": "Attribute of a decoder layer holding its MLP."})
    gate: str | None = field(default="gate_proj", metadata={"help": "Gate projection name; None when fused."})
    up: str | None = field(default="up_proj", metadata={"help": "Up projection name; None when fused."})
    down: str = field(default="down_proj", metadata={"help": "Down projection name."})
    gate_up: str | None = field(
        default=None, metadata={"help": "Fused gate+up projection name (gate rows first), or None."}
    )
    act_key: str = field(default="hidden_act", metadata={"help": "Config key of the gate activation."})

    @property
    def projections(self) -> tuple[str, ...]:
        """Names of the MLP's nn.Linear children, in a fixed order."""
        if self.gate_up:
            return (self.gate_up, self.down)
        return (self.gate, self.up, self.down)

    @property
    def gate_source(self) -> str:
        """Name of the projection whose output holds the gate pre-activation (see `gate_from_output`)."""
        return self.gate_up or self.gate

    def gate_from_output(self, out: torch.Tensor) -> torch.Tensor:
        """The gate pre-activation within the output of `gate_source` (first half when fused)."""
        return out.chunk(2, dim=-1)[0] if self.gate_up else out

    def causal_lm_class(self) -> type[nn.Module]:
        """The transformers CausalLM class of the family."""
        module, _, name = self.causal_lm.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def layout(self) -> dict:
        """The module layout as stored in a checkpoint's `config.twell["mlp"]`, so that the generic
        modeling file finds the MLPs without this table."""
        return {k: v for k, v in asdict(self).items() if k not in ("family", "causal_lm")}


def _spec(family: str, causal_lm: str, **kwargs) -> FamilySpec:
    return FamilySpec(family=family, causal_lm=f"transformers.models.{causal_lm}", **kwargs)


FAMILIES: dict[str, FamilySpec] = {
    spec.family: spec
    for spec in (
        _spec("llama", "llama.modeling_llama.LlamaForCausalLM"),
        _spec("mistral", "mistral.modeling_mistral.MistralForCausalLM"),
        _spec("qwen2", "qwen2.modeling_qwen2.Qwen2ForCausalLM"),
        _spec("qwen3", "qwen3.modeling_qwen3.Qwen3ForCausalLM"),
        _spec("gemma", "gemma.modeling_gemma.GemmaForCausalLM"),
        _spec("gemma2", "gemma2.modeling_gemma2.Gemma2ForCausalLM", act_key="hidden_activation"),
        _spec("gemma3_text", "gemma3.modeling_gemma3.Gemma3ForCausalLM", act_key="hidden_activation"),
        _spec("phi3", "phi3.modeling_phi3.Phi3ForCausalLM", gate=None, up=None, gate_up="gate_up_proj"),
    )
}

def spec_for(config) -> FamilySpec:
    """The family entry for a transformers config; UnsupportedModelError for anything not in the table."""
    problem = family_problem(lambda name: getattr(config, name, None))
    if problem:
        raise UnsupportedModelError(problem)
    return FAMILIES[config.model_type]


def mlp_modules(model: nn.Module, spec: FamilySpec) -> list[nn.Module]:
    """The MLP module of every decoder layer, in layer order."""
    return [getattr(layer, spec.mlp) for layer in model.get_submodule(spec.layers)]


def gate_weight(mlp: nn.Module, spec: FamilySpec) -> torch.Tensor:
    """Gate weight [I, D]; a view into the fused weight for fused families."""
    if spec.gate_up:
        return getattr(mlp, spec.gate_up).weight.chunk(2, dim=0)[0]
    return getattr(mlp, spec.gate).weight


def up_weight(mlp: nn.Module, spec: FamilySpec) -> torch.Tensor:
    """Up weight [I, D]; a view into the fused weight for fused families."""
    if spec.gate_up:
        return getattr(mlp, spec.gate_up).weight.chunk(2, dim=0)[1]
    return getattr(mlp, spec.up).weight


def down_weight(mlp: nn.Module, spec: FamilySpec) -> torch.Tensor:
    """Down weight [D, I]."""
    return getattr(mlp, spec.down).weight


def has_bias(mlp: nn.Module, spec: FamilySpec) -> bool:
    """Whether any projection has a bias (e.g. Llama with mlp_bias=True): the kernels take none."""
    return any(getattr(mlp, name).bias is not None for name in spec.projections)
