import importlib

import pytest
import torch
from torch import nn
from transformers import GPT2Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from helpers import HIDDEN, INTERMEDIATE, LAYERS, tiny_config, tiny_model
from sparsify.errors import UnsupportedModelError
from sparsify.families import FAMILIES, down_weight, gate_weight, mlp_modules, spec_for, up_weight
from sparsify.locations import FAMILY_NAMES, family_config


def _import(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_torch_free_family_names_are_the_tables():
    """The CLI tells a supported source before importing torch by locations.FAMILY_NAMES: the table's families."""
    assert FAMILY_NAMES == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_table_matches_transformers(family):
    model, _ = tiny_model(family)
    spec = spec_for(model.config)
    assert spec.family == family
    assert type(model) is _import(spec.causal_lm)
    mlps = mlp_modules(model, spec)
    assert len(mlps) == LAYERS
    for mlp in mlps:
        for name in spec.projections:
            assert isinstance(getattr(mlp, name), nn.Linear)
        assert gate_weight(mlp, spec).shape == (INTERMEDIATE, HIDDEN)
        assert up_weight(mlp, spec).shape == (INTERMEDIATE, HIDDEN)
        assert down_weight(mlp, spec).shape == (HIDDEN, INTERMEDIATE)
    assert getattr(model.config, spec.act_key) != "relu"  # the key the family's MLP reads exists


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gate_accessors_follow_the_module(family):
    """The gate/up accessors (views for fused weights) give what the family's own MLP computes."""
    model, _ = tiny_model(family)
    spec = spec_for(model.config)
    mlp = mlp_modules(model, spec)[0]
    x = torch.randn(5, HIDDEN)
    gate, up = gate_weight(mlp, spec), up_weight(mlp, spec)
    torch.testing.assert_close(spec.gate_from_output(getattr(mlp, spec.gate_source)(x)), x @ gate.T)
    expected = (mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn)(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(mlp(x), expected @ down_weight(mlp, spec).T)
    if spec.gate_up:  # views, not copies: training through them updates the checkpoint's tensor
        fused = getattr(mlp, spec.gate_up).weight
        assert gate.data_ptr() == fused.data_ptr() and up.untyped_storage().data_ptr() == fused.data_ptr()


@pytest.mark.parametrize(
    "config, kind",
    [
        (GPT2Config(n_layer=1, n_embd=32, n_head=2), "not a gated-MLP"),
        (MixtralConfig(num_hidden_layers=1, hidden_size=32), "mixture-of-experts"),
        (Qwen2MoeConfig(num_hidden_layers=1, hidden_size=32), "mixture-of-experts"),
        (Qwen3MoeConfig(num_hidden_layers=1, hidden_size=32), "mixture-of-experts"),
    ],
)
def test_unsupported_architectures_name_the_supported_families(config, kind, tmp_path):
    with pytest.raises(UnsupportedModelError) as error:
        spec_for(config)
    message = str(error.value)
    assert kind in message and repr(config.model_type) in message
    assert all(family in message for family in FAMILIES)
    config.save_pretrained(tmp_path)  # the CLI's check before torch, from config.json, says the same
    with pytest.raises(UnsupportedModelError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        family_config(str(tmp_path))


def test_layout_is_what_a_checkpoint_needs():
    spec = spec_for(tiny_config("phi3"))
    assert spec.layout() == {
        "layers": "model.layers", "mlp": "mlp", "gate": None, "up": None, "down": "down_proj",
        "gate_up": "gate_up_proj", "act_key": "hidden_act",
    }
