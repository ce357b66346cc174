"""Modeling file of checkpoints converted by sparsify. `AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)` builds the original CausalLM (BASE_MODEL, written at export) and swaps each decoder
layer's MLP for a `TwellGatedMLP` that keeps the projections under their own names, so the standard weights
load unchanged. A layer planned sparse runs the TwELL kernels where its plan's token windows and routing.py
say they win and they can run (CUDA; CPU fp32/fp16 under TRITON_INTERPRET=1); otherwise, and whenever
gradients are needed or the projections are wrapped (adapters), hooked or offloaded, the same ReLU math
runs through the projections' own forward. Eager decode steps replay CUDA graphs (graphs.py);
traced calls use this checkpoint's own custom op (gated_mlp.op_name). `generate` decodes through
generation.py's graphed loop where the call fits it.
The decoder's elementwise work runs fused where the family is in DECODER_FUSIONS (fuse_decoder): its RMSNorm
modules on rms_norm.py's kernel and the attention's rotary embedding on rotary.py's, each installed as the
module's own `forward`; so do the attention's projections at decode size on small_linear.py's (q, k and v in
one launch), under CUDA-graph capture (ProjectionGroup.signature). An installed forward runs
transformers' forward instead where gradients are recorded, under torch.compile (which fuses that code
itself), on CPU without the Triton interpreter, or for inputs the kernels do not take. The modules, their
classes and the weights stay transformers'. Imports torch, transformers and the files beside it only.
"""
import functools
import importlib
import inspect
import os
import types
import warnings
from dataclasses import dataclass

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
from .reference import rms_norm_reference, rotary_reference
from .rms_norm import rms_norm_fits, rms_norm_fitted
from .rotary import rotary_fits, rotary_fitted
from .small_linear import MAX_ROWS as SMALL_LINEAR_ROWS
from .small_linear import small_linear_fits, small_linear_fitted, small_linear_grouped_fits, small_linear_grouped_fitted

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

    def use_kernel(self, x, tokens: int):
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
                warnings.warn("twell: Triton is not installed, so the MLPs run dense (pip install triton)",
                              stacklevel=2)
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
        if not self.use_kernel(x, tokens):
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


@dataclass(frozen=True)
class DecoderFusion:
    """What the fused kernels take over in a family's decoder."""

    norm: str  # the family's RMSNorm class (by name): every instance in the model, Qwen3's q / k norms too
    form: str  # what it computes (rms_norm.FORMS)
    eps: str = "variance_epsilon"  # its attribute holding epsilon
    # the attention's nn.Linear projections (attribute names), in groups that project the same input: a group's
    # decode-size calls make one small_linear launch
    projections: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",))


# Per family (config.model_type). A class that no longer computes its form (another transformers release) keeps
# its own forward (norm_computes); so does an attention whose apply_rotary_pos_emb differs from the standard one
# (rotary_computes).
DECODER_FUSIONS = {
    "llama": DecoderFusion("LlamaRMSNorm", "llama"),
    "mistral": DecoderFusion("MistralRMSNorm", "llama"),
    "qwen2": DecoderFusion("Qwen2RMSNorm", "llama"),
    "qwen3": DecoderFusion("Qwen3RMSNorm", "llama"),
    "phi3": DecoderFusion("Phi3RMSNorm", "llama", projections=(("qkv_proj",), ("o_proj",))),
    "gemma": DecoderFusion("GemmaRMSNorm", "gemma", eps="eps"),
    "gemma2": DecoderFusion("Gemma2RMSNorm", "gemma", eps="eps"),
    "gemma3_text": DecoderFusion("Gemma3RMSNorm", "gemma", eps="eps"),
}


def fused(x, *tensors) -> bool:
    """Whether the decoder's kernels serve a call on x (and `tensors`, None among them ignored): eager or captured
    (traced code runs transformers' modules, which the compiler fuses itself), plain tensors, no gradient to
    record, Triton there (CUDA; CPU under the interpreter), a dtype they take (the interpreter has no bf16
    arithmetic)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or type(x) is not torch.Tensor:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors)):
        return False
    kernel_dtypes = KERNEL_DTYPES if x.is_cuda else (torch.float32, torch.float16) if INTERPRET else ()
    return x.dtype in kernel_dtypes and use_triton(x)


def norm_forward(norm, form: str, eps: str, hidden_states):
    """A decoder RMSNorm's forward (installed on the module): the kernel where it serves the call, else the
    module's own."""
    if fused(hidden_states, norm.weight) and rms_norm_fits(hidden_states, norm.weight, form):
        return rms_norm_fitted(hidden_states, norm.weight, getattr(norm, eps), form)
    return type(norm).forward(norm, hidden_states)


def fused_rotary(apply_rotary, q, k, cos, sin, *args, **kwargs):
    """A family's apply_rotary_pos_emb (`apply_rotary`) on the kernel where it serves the call."""
    if not args and not kwargs and fused(q, k) and rotary_fits(q, k, cos, sin):
        return rotary_fitted(q, k, cos, sin)
    return apply_rotary(q, k, cos, sin, *args, **kwargs)


class ProjectionGroup:
    """nn.Linear projections of one attention that take the same input (its q, k and v). A call of the first on
    a tensor x launches small_linear_grouped for all and keeps the others' outputs, which their calls on that same
    tensor take, once each (transformers' attention forwards project their hidden states by q, k and v in turn);
    any other call launches its own. Each call's arguments are checked once: the group's by the first's call,
    which covers the calls that take a kept output. On a GPU the launches serve calls captured into a CUDA graph
    (`signature` says why)."""

    def __init__(self, linears):
        self.linears = tuple(linears)
        self.kept = None  # (x, {index: output}) of the last grouped launch, until each output is taken
        self.loaded = set()  # signatures of the uncaptured CUDA calls that launched (`signature`)

    def __call__(self, linear, x):
        """linear(x): a kept output, else the kernel where its signature is not loaded and `launch` serves it, else
        the module's own forward. The cheap checks go first: they turn a warm uncaptured call away."""
        index = self.linears.index(linear)
        kept = self.kept  # read once: a launch on another thread replaces it whole
        signature = self.signature(index, x)
        if kept is not None and kept[0] is x and index in kept[1]:
            output = kept[1].pop(index)
            if not kept[1]:
                self.kept = None
            if signature is not None:  # its calls of this signature take the group's launch, already loaded
                self.loaded.add(signature)
            return output
        if signature in self.loaded:
            return type(linear).forward(linear, x)
        output = self.launch(index, linear, x)
        if output is None:
            return type(linear).forward(linear, x)
        if signature is not None:
            self.loaded.add(signature)
        return output

    def launch(self, index, linear, x):
        """The group's launch (for the first projection) or the projection's own where fused() serves the call
        and small_linear takes its arguments; None where it does not."""
        weights, biases = [p.weight for p in self.linears], [p.bias for p in self.linears]
        if not fused(x, *weights, *biases):
            return None
        if index == 0 and len(weights) > 1 and small_linear_grouped_fits(x, weights, biases):
            outputs = small_linear_grouped_fitted(x, weights, biases)
            self.kept = (x, dict(enumerate(outputs[1:], 1)))
            return outputs[0]
        if small_linear_fits(x, linear.weight, linear.bias):
            return small_linear_fitted(x, linear.weight, linear.bias)
        return None

    @staticmethod
    def signature(index, x):
        """What marks an uncaptured CUDA call of projection `index` on x as loaded once it launched; None for the
        calls that always launch: on CPU (the interpreter, the tests' setup, has no host launch time to weigh) and
        under CUDA-graph capture. The kernel's GPU time beats cuBLAS's at decode shapes, but its Triton launcher
        takes several times cuBLAS's host time a call, which an uncaptured decode step waits for; a graph's replay
        launches it without the host. CUDA cannot load a module during a capture, so the first uncaptured call of
        each signature that the kernel serves (the warm-up before a capture) launches it: that compiles and loads
        the kernel which the capture then launches."""
        if not x.is_cuda or not eager(x):
            return None
        return index, x.shape, x.stride(), x.dtype, x.device


def projection_forward(group, linear, x):
    """An attention projection's forward (installed on the nn.Linear): small_linear where it serves the call (at
    most its MAX_ROWS tokens; on a GPU, captured), through the projection's group; else the module's own. The row
    count goes first: it turns a prefill's calls away before any other check."""
    if x.numel() <= SMALL_LINEAR_ROWS * x.shape[-1]:
        return group(linear, x)
    return type(linear).forward(linear, x)


def fuse_attention_projections(attention, groups, enabled: bool = True) -> None:
    """Installs projection_forward on `attention`'s projections named in `groups` (DecoderFusion.projections),
    a ProjectionGroup for each group of plain nn.Linear layers; enabled=False takes it off again."""
    for names in groups:
        linears = [getattr(attention, name, None) for name in names]
        if not all(type(linear) is nn.Linear for linear in linears):
            continue
        group = ProjectionGroup(linears)
        for linear in linears:
            if enabled:
                linear.forward = functools.partial(projection_forward, group, linear)
            elif getattr(vars(linear).get("forward"), "func", None) is projection_forward:
                del linear.forward


_ROTARY_FORWARDS = {}  # attention class -> its forward reading apply_rotary_pos_emb as fused_rotary


def rotary_forward(attention):
    """`attention`'s class's forward with its module's apply_rotary_pos_emb on the kernel: the same code object
    (without its decorators, which only rename deprecated arguments that the decoder layers do not pass) over a
    copy of its module's globals (installed on the module; traced calls take the class's forward)."""
    cls = type(attention)
    if cls not in _ROTARY_FORWARDS:
        forward = inspect.unwrap(cls.forward)
        names = dict(forward.__globals__,
                     apply_rotary_pos_emb=functools.partial(fused_rotary, forward.__globals__["apply_rotary_pos_emb"]))
        copy = types.FunctionType(forward.__code__, names, forward.__name__, forward.__defaults__, forward.__closure__)
        copy.__kwdefaults__ = forward.__kwdefaults__
        _ROTARY_FORWARDS[cls] = copy
    return _ROTARY_FORWARDS[cls]


def attention_forward(attention, *args, **kwargs):
    if torch.compiler.is_compiling():
        return type(attention).forward(attention, *args, **kwargs)
    return rotary_forward(attention)(attention, *args, **kwargs)


@functools.cache
def norm_computes(norm_class, form: str, eps: str) -> bool:
    """Whether norm_class(width) computes rms_norm_reference's `form` with epsilon in attribute `eps` (equal bits
    on a CPU probe, fp32 and bf16; a probe that fails says no)."""
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.device("cpu"), torch.no_grad():
            probe = norm_class(24)
            for dtype in (torch.float32, torch.bfloat16):
                probe.to(dtype).weight.copy_(torch.randn(24, generator=generator))
                x = torch.randn(3, 24, generator=generator).to(dtype)
                expected = rms_norm_reference(x, probe.weight, getattr(probe, eps), form)
                if not torch.equal(norm_class.forward(probe, x), expected):
                    return False
    except Exception:  # noqa: BLE001 (another transformers release's module: it keeps its own forward)
        return False
    return True


@functools.cache
def rotary_computes(apply_rotary) -> bool:
    """Whether a family's apply_rotary_pos_emb computes rotary_reference (equal bits on a CPU probe, bf16; a probe
    that fails says no)."""
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.device("cpu"):
            q, k, cos, sin = (torch.randn(shape, generator=generator).bfloat16()
                              for shape in ((2, 4, 5, 8), (2, 2, 5, 8), (2, 5, 8), (2, 5, 8)))
            expected = rotary_reference(q, k, cos, sin)
            return all(torch.equal(a, b) for a, b in zip(apply_rotary(q, k, cos, sin), expected))
    except Exception:  # noqa: BLE001 (another transformers release's function: the attention keeps it)
        return False


def fuse_decoder(model, layers) -> None:
    """Installs the fused forwards of the family's DECODER_FUSIONS entry on the model's norms and its decoder
    layers' attention (rotary) and attention projections."""
    fusion = DECODER_FUSIONS.get(model.config.model_type)
    if fusion is None:
        return
    norms = [m for m in model.modules() if type(m).__name__ == fusion.norm]
    if norms and norm_computes(type(norms[0]), fusion.form, fusion.eps):
        for norm in norms:
            norm.forward = functools.partial(norm_forward, norm, fusion.form, fusion.eps)
    for layer in layers:
        forward = inspect.unwrap(type(layer.self_attn).forward)
        apply_rotary = forward.__globals__.get("apply_rotary_pos_emb")
        if apply_rotary is not None and rotary_computes(apply_rotary):
            layer.self_attn.forward = functools.partial(attention_forward, layer.self_attn)
        fuse_attention_projections(layer.self_attn, fusion.projections)


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
        fuse_decoder(self, layers)

    def fuse_projections(self, enabled: bool = True) -> None:
        """Runs the attention projections' captured decode-size calls on small_linear (as loaded) or,
        enabled=False, on their own forward (to time the two in one process); frees the graphed decode loop,
        which captured one."""
        fusion = DECODER_FUSIONS.get(self.config.model_type)
        if fusion is not None:
            release_graphed(self)
            for layer in self.get_submodule(self.config.twell["mlp"]["layers"]):
                fuse_attention_projections(layer.self_attn, fusion.projections, enabled)

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
