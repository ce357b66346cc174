"""Modeling file of checkpoints converted by sparsify. `AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)` builds the original CausalLM (BASE_MODEL, written at export) and swaps each decoder
layer's MLP for a `TwellGatedMLP` that keeps the projections under their own names, so the standard weights
load unchanged. A layer planned sparse runs the TwELL kernels where its plan's token windows and routing.py
say they win and they can run (CUDA; CPU fp32/fp16 under TRITON_INTERPRET=1); otherwise, and whenever
gradients are needed or the projections are wrapped (adapters), hooked or offloaded, the same ReLU math
runs through the projections' own forward. Eager decode steps replay CUDA graphs (graphs.py);
traced calls use this checkpoint's own custom op (gated_mlp.op_name). `generate` decodes through
generation.py's graphed loop where the call fits it. Imports torch, transformers and the files beside it only.
"""
import importlib
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin

from .format import use_triton
from .gated_mlp import KERNEL_DTYPES, gated_mlp, prepare_down
from .graphs import DecodeGraphs
from .routing import ActivityRouter, eager, eager_dense, short_prefill
from .generation import LoopUnsupported, generate_graphed, graphed_call, release_graphed
from .layer_plan import LayerPlan, layer_plans

BASE_MODEL = "transformers.models.llama.modeling_llama.LlamaForCausalLM"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it when the kernels are defined, too


def _import(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class TwellGatedMLP(nn.Module):
    """down(relu(gate(x)) * up(x)) over one layer's original projections, on TwELL kernels when planned."""

    def __init__(self, original, layout, plan: LayerPlan):
        super().__init__()
        self.gate_up_name = layout.get("gate_up")
        self.names = (self.gate_up_name,) if self.gate_up_name else (layout["gate"], layout["up"])
        self.down_name = layout["down"]
        self.projection_names = (*self.names, self.down_name)
        for name in self.projection_names:
            self.add_module(name, getattr(original, name))
        self.plan = plan
        # the windows with an int bound, compared without branching on None at each call
        self._windows = tuple((lo, hi if hi is not None else 2 ** 62) for lo, hi in plan.sparse_tokens)
        # whether the kernels may serve this layer at all (a bias is structural: fixed once built)
        self.kernel_ready = plan.is_sparse and all(getattr(self, name).bias is None for name in self.projection_names)
        self.width, self.d = self._gate_up_weights()[0].shape
        # eager decode calls replay CUDA graphs of the kernels: the two launches cost more host time than
        # the dense block's cuBLAS calls, the graph far less (graphs.py)
        self.graphs = DecodeGraphs()
        self.router = None  # ActivityRouter of eager batched calls, made at the first one on each device
        self.prepare_kernel_layout()  # models built from a config; from_pretrained again once loaded

    def _plain_weights(self):
        """The projections' weights (down last) where the projections are still plain nn.Linear layers whose
        weights the kernels may read in place of their forward: not wrapped (LoRA adapters, quantized layers),
        hooked or offloaded (weights on the meta device until accelerate's hook brings them in); else None. At
        every call, so through the modules' dicts."""
        modules, weights = self._modules, []
        for name in self.projection_names:
            p = modules[name]
            if p.__class__ is not nn.Linear or p._forward_hooks or p._forward_pre_hooks:
                return None
            weight = p._parameters["weight"]
            if weight.is_meta:
                return None
            weights.append(weight)
        return weights

    def _gate_up_weights(self):
        if self.gate_up_name:
            return getattr(self, self.gate_up_name).weight.chunk(2, dim=0)
        return tuple(getattr(self, name).weight for name in self.names)

    def in_window(self, tokens: int) -> bool:
        """Whether a call of `tokens` tokens lies in one of the plan's sparse_tokens ranges (plain Python on
        the static token count: under torch.compile a guard, not a graph break)."""
        return any(lo <= tokens <= hi for lo, hi in self._windows)

    def _use_kernel(self, x, tokens: int):
        """Whether the plan and the call of `tokens` tokens let the kernels serve it (the cheap, common
        refusals first: they are host time on every call of a dense-routed layer)."""
        if not self.kernel_ready or not self.in_window(tokens):
            return False
        weights = self._plain_weights()
        if weights is None:
            return False
        if x.is_cuda and short_prefill(x.shape, self.d, self.width):  # heavy first tokens (routing.py)
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return False
        if not use_triton(x):  # without Triton the kernels' fp32 reference would be slower than dense
            if x.is_cuda:
                warnings.warn("twell: Triton is not installed, so the MLPs run dense (pip install triton)", stacklevel=2)
            return False
        # the kernels take x and the weights in one dtype (not under autocast, which leaves the weights as
        # they are); the interpreter has no bf16 arithmetic
        kernel_dtypes = KERNEL_DTYPES if x.is_cuda else (torch.float32, torch.float16) if INTERPRET else ()
        return x.dtype in kernel_dtypes and x.dtype == weights[-1].dtype

    def prepare_kernel_layout(self):
        """Stores the down weight transposed (same shape and values; its .t() contiguous) where the kernels
        may serve this layer: the kernels read it so, and copy it at every call otherwise (a weight assigned
        after loading: call this again). In place of the parameter's data (the parameter stays the same
        object); moves and casts (.to) and load_state_dict keep the layout. Weights on the meta device
        (not loaded yet, or offloaded) are left as they are."""
        down = getattr(self, self.down_name).weight
        if self.kernel_ready and not down.is_meta and not down.t().is_contiguous():
            with torch.inference_mode(False):  # a normal tensor even when first called in inference mode
                down.data = prepare_down(down.data)

    def forward(self, x):
        tokens = x.numel() // x.shape[-1]
        if not self._use_kernel(x, tokens):
            return self._dense(x)
        gate, up = self._gate_up_weights()
        down = getattr(self, self.down_name).weight
        kernel = dict(tile=self.plan.tile, compression=self.plan.compression,
                      precision="highest" if x.dtype == torch.float32 else "default")
        if not eager(x):  # traced (the custom op) or captured: no host time, no activity routing
            return gated_mlp(x, gate, up, down, **kernel)
        if x.shape[-2] == 1:  # a decode step: replayed as a CUDA graph (graphs.py says where it can)
            return self.graphs(gated_mlp, x, gate, up, down, **kernel)
        if x.is_cuda and eager_dense(tokens, self.d, self.width):  # host-bound on a GPU: dense
            return self._dense(x)
        if self.router is None or self.router.device != x.device:
            self.router = ActivityRouter(self.d, self.width, self.plan.mean_active or 0.0, x.device)
        counter = self.router.overflow_counter(x, tokens)
        if counter is None:  # the layer's recent calls were so active that the kernels lose
            return self._dense(x)
        out = gated_mlp(x, gate, up, down, overflow=counter, **kernel)
        self.router.after_kernel_call()
        return out

    def _dense(self, x):
        if self.gate_up_name:
            gate, up = getattr(self, self.gate_up_name)(x).chunk(2, dim=-1)
        else:
            gate, up = (getattr(self, name)(x) for name in self.names)
        return getattr(self, self.down_name)(F.relu(gate) * up)


class TwellForCausalLM(_import(BASE_MODEL), GenerationMixin):
    """The base CausalLM with each decoder layer's MLP replaced by a TwellGatedMLP. GenerationMixin among its
    own bases: transformers otherwise wraps a remote class in a new one at each load, which cannot be pickled."""

    def __init__(self, config):
        super().__init__(config)
        layout = config.twell["mlp"]
        layers = self.get_submodule(layout["layers"])
        plans = layer_plans(config.twell)
        if len(plans) != len(layers):
            raise ValueError(f"config.twell plans {len(plans)} layers, the model has {len(layers)}")
        for layer, plan in zip(layers, plans):
            setattr(layer, layout["mlp"], TwellGatedMLP(getattr(layer, layout["mlp"]), layout, plan))

    def generate_graphed(self, input_ids, max_new_tokens, **options):
        """Greedy or sampled continuation with one CUDA-graph replay a token, no Python loop on the host
        between tokens (generation.py; `compile=True` for the fastest step)."""
        return generate_graphed(self, input_ids, max_new_tokens, **options)

    def generate(self, inputs=None, **kwargs):
        """transformers' generate, through generate_graphed's loop where the call fits it (generation.graphed_call:
        greedy or sampling with temperature / top_k / top_p, left-padded batches, eos and pad, a streamer);
        every other call, and any with `graphed=False`, goes to transformers' own generate."""
        call = graphed_call(self, inputs, kwargs)
        if call is not None:
            try:
                return generate_graphed(self, **call)
            except LoopUnsupported:  # sliding-window attention: found when the first loop is built
                self.__dict__["_loop_unsupported"] = True
        kwargs.pop("graphed", None)
        return super().generate(inputs, **kwargs)

    def release_graphed(self):
        """Frees what generate_graphed keeps for its next call (the static cache and the CUDA graphs)."""
        release_graphed(self)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half() that move the weights free the decode loop, whose cache and graphs belong to the
        # old ones: before the move where the smallest weight shows it coming, so that they do not sit beside
        # the new weights at the peak, and after any move in case it did not
        held = self.__dict__.get("_decode_loop")
        holds_loop = held is not None and held.loop is not None
        smallest = min(self.parameters(), key=torch.Tensor.numel) if holds_loop else None
        if smallest is not None:
            with torch.no_grad():  # as nn.Module._apply calls fn
                if fn(smallest) is not smallest:
                    release_graphed(self)
        before = [p.data_ptr() for p in self.parameters()]
        moved = super()._apply(fn, *args, **kwargs)
        if [p.data_ptr() for p in self.parameters()] != before:
            release_graphed(self)
        return moved

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """The base class's loading, then the kernels' down-weight layout, once, outside any compiled region."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading info) on request
        for module in model.modules():
            if isinstance(module, TwellGatedMLP):
                module.prepare_kernel_layout()
        return loaded


def _register_causal_lm() -> None:
    """Lists TwellForCausalLM among transformers' causal LMs by class name, where the text-generation pipeline,
    Trainer and `transformers serve` look a model up: else the pipeline logs a several-kilobyte "not supported for
    text-generation" error for every checkpoint. Under a key that names no config type, so that no auto class
    resolves through it."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # a transformers without the table: nothing looks the name up there
        return
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("twell", TwellForCausalLM.__name__)


_register_causal_lm()
