"""Modeling file of checkpoints converted by sparsify. `AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)` builds the original CausalLM (BASE_MODEL, written at export) and swaps each decoder layer's MLP
for a `TwellGatedMLP` that keeps the projections under their own names, so the standard weights load unchanged. A layer
planned sparse runs the TwELL kernels where its plan's token windows and routing.py say they win and they can run (CUDA;
CPU fp32/fp16 under TRITON_INTERPRET=1); otherwise, and whenever gradients are needed or the projections are wrapped
(adapters), hooked or offloaded, the same ReLU math runs through the projections' own forward. Eager decode steps replay
CUDA graphs (graphs.py); traced calls use this checkpoint's own custom op (gated_mlp.op_name). `generate` decodes
through generation.py's graphed loop where the call fits it. `use_fp8_gate()` opts in to the fp8 gate (fp8_gate.py) on
the batched path's calls, `use_fp8_up_down()` to e4m3 up and down rows on its larger ones. The decoder's elementwise
work runs fused where the family is in DECODER_FUSIONS (fuse_decoder): its RMSNorm modules on rms_norm.py's kernel and
the attention's rotary embedding on rotary.py's (decoder.py, differentiable); so do the attention's projections at
decode size on small_linear.py's (q, k and v in one launch), under CUDA-graph capture (ProjectionGroup.signature) and
under torch.compile (its custom op), where no gradient is recorded, and where the model's attention is transformers'
sdpa, its decode-size calls on decode_attention.py's kernel, captured or traced (attention_forward, registered as the
attention implementation ATTENTION); a static cache's updates run on cache_write.py's (decoder.WritingCache), and a
pre-norm layer's residual adds in the kernel of its second norm and, in a captured one-token step, in the MLP's tile sum
(decoder.pre_norm_layer). The norms and rotary run transformers' forward instead under torch.compile (which fuses that
code itself); every installed forward does on CPU without the Triton interpreter, or for inputs the kernels do not take.
The modules, their classes and the weights stay transformers'. Imports torch, transformers and the files beside it
only.
"""
import functools
import importlib
import math
import warnings
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin

from .format import use_triton
from .fp8_gate import E4m3Copy, quantize_up_down, quantize_weight
from .gated_mlp import KERNEL_DTYPES, gated_mlp, prepare_down
from .graphs import DecodeGraphs
from .paths import reads_fp8_gate, reads_fp8_up_down
from .routing import ActivityRouter, eager, eager_dense, short_prefill
from .generation import LoopUnsupported, generate_graphed, graphed_call, release_graphed
from .layer_plan import LayerPlan, layer_plans
from .decode_attention import decode_attention_fits, decode_attention_fitted, decode_attention_wins
from .decoder import DECODER_FUSIONS, INTERPRET, fuse_norms_and_rotary, serves, takes
from .small_linear import MAX_ROWS as SMALL_LINEAR_ROWS
from .small_linear import (small_linear_fits, small_linear_fitted, small_linear_grouped_fits, small_linear_grouped_fitted,
                           small_linear_wins)
from .launch import op_name, sm_count

try:
    from transformers import AttentionInterface
    from transformers.integrations import sdpa_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # a transformers without attention functions: the model's own attention runs
    AttentionInterface = None

BASE_MODEL = "transformers.models.llama.modeling_llama.LlamaForCausalLM"
PLAIN_TENSORS = (nn.Parameter, torch.Tensor)  # weights the kernels read; not subclasses such as DTensor


def _import(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class TwellGatedMLP(nn.Module):
    """down(relu(gate(x)) * up(x)) over one layer's original projections, on TwELL kernels when planned."""

    adds_residual = True  # forward takes the decoder layer's residual (decoder.pre_norm_layer passes it)

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
        self.fp8_gate = False  # whether the kernels' gate pass reads an e4m3 copy of the gate (use_fp8_gate)
        self.fp8_up_down = False  # whether their out pass reads e4m3 up and down rows (use_fp8_up_down)
        self._gate_e4m3, self._up_down_e4m3 = E4m3Copy(quantize_weight), E4m3Copy(quantize_up_down)
        self.prepare_kernel_layout()  # models built from a config; from_pretrained again once loaded

    def extra_repr(self) -> str:
        """The layer's plan in print(model): whether and where it runs on the kernels."""
        if not self.plan.is_sparse:
            return "plan: dense"
        windows = ", ".join(f"{lo}+" if hi is None else f"{lo}" if lo == hi else f"{lo}-{hi}"
                            for lo, hi in self.plan.sparse_tokens)
        plan = (f"plan: TwELL kernels at {windows} tokens a call, tile {self.plan.tile}, "
                f"compression {self.plan.compression}")
        return plan if self.kernel_ready else f"{plan}; runs dense: its projections have biases"

    def _plain_weights(self):
        """The projections' weights (down last) where the projections are still plain nn.Linear layers whose
        weights the kernels may read in place of their forward: not wrapped (LoRA adapters, quantized layers),
        hooked or offloaded (weights on the meta device until accelerate's hook brings them in), not tensor
        subclasses (a tensor-parallel plan's DTensor shards); else None. At every call, so through the modules'
        dicts."""
        modules, weights = self._modules, []
        for name in self.projection_names:
            p = modules[name]
            if p.__class__ is not nn.Linear or p._forward_hooks or p._forward_pre_hooks:
                return None
            weight = p._parameters["weight"]
            if type(weight) not in PLAIN_TENSORS or weight.is_meta:
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

    def use_fp8_gate(self, enabled: bool = True):
        """Whether the kernels' gate pass reads an e4m3 copy of the gate weight (fp8_gate.py; 16-bit x only),
        made now where the weight is on a GPU, else at the next kernel call, and again after the weight changes
        (fp8_gate.E4m3Copy). The weight itself stays, for up, down and every dense path."""
        self.fp8_gate = enabled
        self._hold_e4m3(self._gate_e4m3, enabled, self._gate_up_weights()[0])

    def use_fp8_up_down(self, enabled: bool = True):
        """Whether the kernels' out pass reads e4m3 copies of the up and down rows (fp8_gate.quantize_up_down;
        16-bit x, the batched calls where paths.reads_fp8_up_down says they win), made and remade as use_fp8_gate's.
        The weights themselves stay, for every dense path (heavy rows and overflowing tiles included)."""
        self.fp8_up_down = enabled
        self._hold_e4m3(self._up_down_e4m3, enabled, *self._up_down_weights())

    def gate_e4m3(self):
        """(e4m3 weight, row scales): the copy of the gate that the kernels' gate pass reads with use_fp8_gate,
        made now if not held; None where they read the gate itself (fp8 gate off, or a layer planned dense)."""
        return self._gate_e4m3(self._gate_up_weights()[0]) if self.fp8_gate and self.kernel_ready else None

    def _hold_e4m3(self, copy: E4m3Copy, enabled: bool, *weights):
        copy.drop()
        if enabled and self.kernel_ready and weights[0].is_cuda:
            copy(*weights)

    def _up_down_weights(self):
        return self._gate_up_weights()[1], getattr(self, self.down_name).weight

    def forward(self, x, residual=None):
        """The block of x, plus `residual` where given (a decoder layer's add after its MLP: a captured one-token
        call adds it in its last kernel, every other call after the block)."""
        if residual is not None and eager(x):
            return residual + self._block(x)
        return self._block(x, residual)

    def _block(self, x, residual=None):
        """The block of x, plus `residual` where given: traced or captured calls only (forward)."""
        tokens = x.numel() // x.shape[-1]
        if not self.use_kernel(x, tokens):
            return self._dense(x) if residual is None else residual + self._dense(x)
        gate, up = self._gate_up_weights()
        down = getattr(self, self.down_name).weight
        kernel = dict(tile=self.plan.tile, compression=self.plan.compression,
                      precision="highest" if x.dtype == torch.float32 else "default")
        if (self.fp8_gate or self.fp8_up_down) and x.dtype in (torch.float16, torch.bfloat16):
            if self.fp8_gate and reads_fp8_gate(tokens, self.d, self.width):
                kernel["gate_fp8"] = self._gate_e4m3(gate)
            if self.fp8_up_down and reads_fp8_up_down(tokens, self.d, self.width):
                kernel["up_down_fp8"] = self._up_down_e4m3(up, down)
        if not eager(x):  # traced (the custom op) or captured: no host time, no activity routing
            return gated_mlp(x, gate, up, down, residual=residual, **kernel)
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


def fused(x, *tensors) -> bool:
    """Whether the attention's kernels (its projections', its attention's) serve a call on x (and `tensors`, None
    among them ignored): none of them a tensor subclass (a tensor-parallel plan's DTensor shards), no gradient is
    recorded (neither kernel has a backward), and where the decoder's kernels do (decoder.serves), or for a call
    traced by torch.compile where they take x (decoder.takes: the trace calls the kernel's custom op; the compiler's
    own code for a decode-size product reads the weights no faster than cuBLAS, in three launches where the group
    makes one, and it calls SDPA for the attention)."""
    if any(t is not None and type(t) not in PLAIN_TENSORS for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors)):
        return False
    return takes(x) if torch.compiler.is_compiling() else serves(x)


@torch.compiler.assume_constant_result
def device_sms(device) -> int:
    """The device's SM count, a constant to torch.compile's trace of a projection's call."""
    return sm_count(device)


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
        # signatures of uncaptured CUDA calls (`signature`) that take the module's own forward from now on: those
        # that launched once (the kernel is loaded) and those that the kernel does not serve
        self.settled = set()

    def __call__(self, linear, x):
        """linear(x): a kept output, else the kernel where its signature is not settled and `launch` serves it,
        else the module's own forward. The cheap checks go first: they turn a warm uncaptured call away."""
        index = self.linears.index(linear)
        kept = self.kept  # read once: a launch on another thread replaces it whole
        signature = self.signature(index, x)
        if kept is not None and kept[0] is x and index in kept[1]:
            output = kept[1].pop(index)
            if not kept[1]:
                self.kept = None
            if signature is not None:  # its calls of this signature take the group's launch, already loaded
                self.settled.add(signature)
            return output
        if signature in self.settled:
            return type(linear).forward(linear, x)
        # what fused() turns away (recorded gradients, a dispatch mode, sharded weights) is a state of the call,
        # not of its signature, which a later call may bring served: it settles nothing
        if not self.fused(x):
            return type(linear).forward(linear, x)
        output = self.launch(index, linear, x)
        if signature is not None:
            self.settled.add(signature)
        return type(linear).forward(linear, x) if output is None else output

    def fused(self, x) -> bool:
        return fused(x, *(p.weight for p in self.linears), *(p.bias for p in self.linears))

    def launch(self, index, linear, x):
        """The group's launch (for the first projection) or the projection's own where small_linear takes its
        arguments and beats cuBLAS there (small_linear_wins), on a call that fused() serves; None elsewhere."""
        weights, biases = [p.weight for p in self.linears], [p.bias for p in self.linears]
        if index == 0 and len(weights) > 1 and small_linear_grouped_fits(x, weights, biases):
            outputs = small_linear_grouped_fitted(x, weights, biases)
            self.kept = (x, dict(enumerate(outputs[1:], 1)))
            return outputs[0]
        rows, k = linear.weight.shape
        if (small_linear_fits(x, linear.weight, linear.bias)
                and small_linear_wins(math.prod(x.shape[:-1]), [rows], k, device_sms(x.device))):
            return small_linear_fitted(x, linear.weight, linear.bias)
        return None

    @staticmethod
    def signature(index, x):
        """What marks an uncaptured CUDA call of projection `index` on x as settled once it ran; None for the
        calls that always launch: on CPU (the interpreter, the tests' setup, has no host launch time to weigh) and
        under CUDA-graph capture. The kernel's GPU time beats cuBLAS's at decode shapes, but its Triton launcher
        takes several times cuBLAS's host time a call, which an uncaptured decode step waits for; a graph's replay
        launches it without the host. CUDA cannot load a module during a capture, so the first uncaptured call of
        each signature that the kernel serves (the warm-up before a capture) launches it: that compiles and loads
        the kernel which the capture then launches."""
        if not x.is_cuda or not eager(x):
            return None
        return index, type(x), x.shape, x.stride(), x.dtype, x.device


def projection_forward(group, linear, x):
    """An attention projection's forward (installed on the nn.Linear): small_linear where it serves the call (at
    most its MAX_ROWS tokens; on a GPU, captured or traced), through the projection's group; else the module's own.
    The row count goes first: it turns a prefill's calls away before any other check."""
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


# This copy's attention implementation: transformers' sdpa with decode-size calls on the kernel (attention_forward)
ATTENTION = f"twell_{op_name('sdpa')}"
# Arguments of an attention call under which it computes other than softmax(q k^T * scale, masked) v
SDPA_ONLY = ("softcap", "s_aux", "position_bias")
# Whether transformers' sdpa attention copies each key/value head for its query heads in a masked grouped-query call
# (repeat_kv), as releases before its pack_gqa did (decode_attention_wins' repeated_kv)
SDPA_REPEATS_KV = AttentionInterface is not None and not hasattr(sdpa_attention, "pack_gqa")
# Signatures of uncaptured CUDA calls (attention_signature) that launched the kernel once, which loaded it: their
# later calls take sdpa, whose launch costs the host less; a CUDA graph's replay launches the kernel without it. The
# last SETTLED_SIGNATURES settled are kept (a growing cache makes a signature a step): one dropped launches again
SETTLED_SIGNATURES = 4096
_SETTLED_ATTENTION = OrderedDict()


def attention_signature(query, key, mask):
    """What marks an uncaptured CUDA attention call as settled once it ran (None: on CPU, under capture, traced)."""
    if not query.is_cuda or not eager(query):
        return None
    return (query.shape, query.stride(), key.shape, key.stride(), query.dtype, query.device,
            None if mask is None else (mask.shape, mask.stride()))


def takes_kernel(signature) -> bool:
    """Whether a call of this attention_signature takes the kernel (and settles the signature): every call of None,
    the first of any other."""
    if signature is None:
        return True
    if signature in _SETTLED_ATTENTION:
        return False
    _SETTLED_ATTENTION[signature] = None
    if len(_SETTLED_ATTENTION) > SETTLED_SIGNATURES:
        _SETTLED_ATTENTION.popitem(last=False)
    return True


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention function, with the calls that decode_attention.py's kernel takes and wins on
    (decode_attention_wins) on it: a few query tokens (one, or more under a mask), no dropout, softcap, sink or
    position bias, where the attention's kernels serve (`fused`: traced calls through the kernel's custom op),
    under CUDA-graph capture or traced (and the first uncaptured call of each signature, which loads the kernel
    before a capture: CUDA cannot load one during it)."""
    if (dropout == 0.0 and not kwargs.get("output_attentions") and all(kwargs.get(k) is None for k in SDPA_ONLY)
            and (query.shape[2] == 1 or attention_mask is not None) and fused(query, key, value, attention_mask)
            and decode_attention_fits(query, key, value, attention_mask)
            and decode_attention_wins(query.shape[0], key.shape[1], device_sms(query.device), repeated_kv=(
                SDPA_REPEATS_KV and attention_mask is not None and query.shape[1] > key.shape[1]))):
        if takes_kernel(attention_signature(query, key, attention_mask)):
            return decode_attention_fitted(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_decode_attention(model, enabled: bool = True) -> None:
    """Makes the model's attention implementation ATTENTION where it is sdpa or, enabled=False, sdpa where it is
    ATTENTION."""
    if AttentionInterface is None:
        return
    current = model.config._attn_implementation
    if enabled and current == "sdpa":
        model.set_attn_implementation(ATTENTION)
    elif not enabled and current == ATTENTION:
        model.set_attn_implementation("sdpa")


def _register_attention() -> None:
    """Registers attention_forward as transformers' attention implementation ATTENTION, with sdpa's masks: at
    import, so that a model unpickled or copied with ATTENTION in its config finds it."""
    if AttentionInterface is not None:
        AttentionInterface.register(ATTENTION, attention_forward)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def fuse_decoder(model, layers) -> None:
    """Installs the fused forwards of the family's DECODER_FUSIONS entry on the model's norms and its decoder
    layers' attention (rotary: decoder.fuse_norms_and_rotary) and attention projections."""
    fusion = fuse_norms_and_rotary(model, layers)
    if fusion is not None:
        for layer in layers:
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
        use_decode_attention(self)

    def use_fp8_gate(self, enabled: bool = True) -> None:
        """Runs the sparse layers' gate pass in fp8 (e4m3, a scale a unit and a token; fp8_gate.py) where the
        kernels serve a 16-bit call, or, enabled=False, in the weights' dtype again. Opt-in: it changes the
        model's numerics; the weights and the checkpoint stay as they are (the e4m3 copies take half the gate
        weights' bytes beside them). Warns where, as the model is now, no call would read it."""
        self._use_e4m3(TwellGatedMLP.use_fp8_gate, "the fp8 gate", enabled)

    def use_fp8_up_down(self, enabled: bool = True) -> None:
        """Runs the sparse layers' out pass on e4m3 copies of the up and down rows (a scale a unit; fp8_gate.py)
        where the kernels serve a 16-bit batched call on which they win (paths.reads_fp8_up_down: from 65 to 513
        tokens on, by the layers' width), or, enabled=False, on the weights again. Opt-in: it changes the model's
        numerics; the weights and the checkpoint stay as they are (the copies take half the up and down weights'
        bytes beside them). Warns where, as the model is now, no call would read them."""
        self._use_e4m3(TwellGatedMLP.use_fp8_up_down, "e4m3 up and down rows", enabled)

    def _use_e4m3(self, layer_method, what: str, enabled: bool) -> None:
        layers = [module for module in self.modules() if isinstance(module, TwellGatedMLP)]
        for module in layers:
            layer_method(module, enabled)
        if not enabled:
            return
        idle = []
        if not any(module.kernel_ready for module in layers):
            idle.append("no layer of this checkpoint is planned on the sparse kernels, which alone read it")
        if self.device.type != "cuda" and not INTERPRET:
            idle.append(f"the model is on {self.device.type}, where the MLPs run dense: the kernels run on a CUDA GPU "
                        f"({what} on one of compute capability 8.9 or newer)")
        if self.dtype not in (torch.float16, torch.bfloat16):
            idle.append(f"the model is {str(self.dtype).removeprefix('torch.')}: only 16-bit calls take {what} "
                        "(load it with dtype=torch.bfloat16)")
        if idle:
            warnings.warn(f"{layer_method.__name__}() changes nothing as the model is now: {'; '.join(idle)}",
                          stacklevel=3)

    def fuse_projections(self, enabled: bool = True) -> None:
        """Runs the attention projections' captured decode-size calls on small_linear (as loaded) or,
        enabled=False, on their own forward (to time the two in one process); frees the graphed decode loop,
        which captured one."""
        fusion = DECODER_FUSIONS.get(self.config.model_type)
        if fusion is not None:
            release_graphed(self)
            for layer in self.get_submodule(self.config.twell["mlp"]["layers"]):
                fuse_attention_projections(layer.self_attn, fusion.projections, enabled)

    def fuse_attention(self, enabled: bool = True) -> None:
        """Runs the captured decode-size attention calls on decode_attention.py's kernel (as loaded, where the
        attention is sdpa) or, enabled=False, on sdpa (to time the two in one process); frees the graphed decode
        loop, which captured one."""
        release_graphed(self)
        use_decode_attention(self, enabled)

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
_register_attention()
