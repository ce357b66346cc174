"""A decoder's elementwise work on the kernels, for inference and training alike: the family's RMSNorm modules on
rms_norm.py's kernel and its attention's rotary embedding on rotary.py's, each installed as the module's own `forward`
(fuse_norms_and_rotary; unfuse_norms_and_rotary takes them off). At inference a pre-norm decoder layer (pre_norm_layer)
also runs its residual add after the attention and its second norm as one launch (rms_norm_add), and hands the residual
after its MLP to an MLP that adds it itself (the modeling file's, in its last kernel). The modules, their classes and
the weights stay transformers'. Both kernels are differentiable and keep less for the backward than transformers'
modules do (an fp32 rstd a row; nothing but the tables), so a training step saves time and memory too.

An installed forward runs transformers' forward instead under torch.compile (which fuses that code itself), for tensor
subclasses (DTensor shards), on CPU without the Triton interpreter, or for inputs the kernels do not take. A family is
installed only where the running transformers still computes what its entry says (norm_computes, rotary_computes,
layer_computes: equal bits on a CPU probe). The attention's forward hands its KV cache on as a WritingCache, whose
static layers' updates run on cache_write.py's kernel (inference: training passes no cache). Imports torch and the files
beside it only."""
import functools
import inspect
import os
import types
from dataclasses import dataclass

import torch

from .cache_write import cache_write_fits, cache_write_fitted
from .format import use_triton
from .gated_mlp import KERNEL_DTYPES
from .reference import cache_write_reference, rms_norm_reference, rotary_reference
from .rms_norm import rms_norm_add_fits, rms_norm_add_fitted, rms_norm_fits, rms_norm_fitted
from .rotary import rotary_fits, rotary_fitted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it when the kernels are defined, too
CACHE_ARGUMENTS = ("cache", "past_key_values")  # the attention's KV cache argument: newer transformers', older


@dataclass(frozen=True)
class DecoderFusion:
    """What the fused kernels take over in a family's decoder."""

    norm: str  # the family's RMSNorm class (by name): every instance in the model, Qwen3's q / k norms too
    form: str  # what it computes (rms_norm.FORMS)
    eps: str = "variance_epsilon"  # its attribute holding epsilon
    # the attention's nn.Linear projections (attribute names), in groups that project the same input: a group's
    # decode-size calls make one small_linear launch (the checkpoint's modeling file, inference only)
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


def serves(x) -> bool:
    """Whether the decoder's kernels serve a call on x: eager or captured (traced code runs transformers'
    modules, which the compiler fuses itself) and `takes` x."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return takes(x)


def takes(x) -> bool:
    """Whether the kernels take a call on x: a plain tensor (not a subclass such as a DTensor shard), Triton there
    (CUDA; CPU under the interpreter), a dtype they compute in (the interpreter has no bf16 arithmetic)."""
    kernel_dtypes = KERNEL_DTYPES if x.is_cuda else (torch.float32, torch.float16) if INTERPRET else ()
    return type(x) is torch.Tensor and x.dtype in kernel_dtypes and use_triton(x)


def norm_forward(norm, form: str, eps: str, hidden_states):
    """A decoder RMSNorm's forward (installed on the module): the kernel where it serves the call, else the
    module's own."""
    if serves(hidden_states) and rms_norm_fits(hidden_states, norm.weight, form):
        return rms_norm_fitted(hidden_states, norm.weight, getattr(norm, eps), form)
    return type(norm).forward(norm, hidden_states)


def add_norm(norm, form: str, eps: str, x, residual):
    """(norm(residual + x), residual + x): one launch of rms_norm_add where the kernels serve the call and no
    gradient is recorded, else the add and the norm module."""
    weight = norm.weight
    if (serves(x) and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                                        or weight.requires_grad))
            and rms_norm_add_fits(x, residual, weight, form)):
        return rms_norm_add_fitted(x, residual, weight, getattr(norm, eps), form)
    summed = residual + x
    return norm(summed), summed


def pre_norm_layer(layer, add_norm, hidden_states, attention_mask=None, **kwargs):
    """A pre-norm decoder layer as Llama's computes it: h = x + attention(input_layernorm(x)), then
    h + mlp(post_attention_layernorm(h)), with `add_norm(attention output, x)` giving (the second norm's output, h).
    An MLP that `adds_residual` (the modeling file's TwellGatedMLP) takes h and adds it itself."""
    attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  **kwargs)
    normed, residual = add_norm(attended, hidden_states)
    if getattr(layer.mlp, "adds_residual", False):
        return layer.mlp(normed, residual=residual)
    return residual + layer.mlp(normed)


def layer_forward(layer, layer_add_norm, hidden_states, *args, **kwargs):
    """A decoder layer's forward (installed on the layer where layer_computes, with add_norm bound to its
    post_attention_layernorm): pre_norm_layer; the class's own under torch.compile (which fuses the add and norm
    itself), in training mode (a family's dropouts) or for positional arguments."""
    if args or layer.training or torch.compiler.is_compiling():
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    return pre_norm_layer(layer, layer_add_norm, hidden_states, **kwargs)


def fused_rotary(apply_rotary, q, k, cos, sin, *args, **kwargs):
    """A family's apply_rotary_pos_emb (`apply_rotary`) on the kernel where it serves the call."""
    if not args and not kwargs and serves(q) and rotary_fits(q, k, cos, sin):
        return rotary_fitted(q, k, cos, sin)
    return apply_rotary(q, k, cos, sin, *args, **kwargs)


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
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            kwargs[name] = WritingCache(kwargs[name])
    return rotary_forward(attention)(attention, *args, **kwargs)


class WritingCache:
    """A KV cache as the fused attention forward hands it on: update() of a static layer on cache_write.py's kernel
    where the kernels serve the call (one launch for transformers' five) and the layer's class computes what the
    kernel does (static_update_computes); every other call and attribute the cache's own."""

    def __init__(self, cache):
        self.cache = cache

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layers = getattr(self.cache, "layers", ())
        layer = layers[layer_idx] if layer_idx < len(layers) else None
        if (layer is not None and getattr(layer, "is_initialized", False)
                and not getattr(self.cache, "offloading", False) and static_update_computes(type(layer))
                and serves(key_states)):
            caches = layer.keys, layer.values, layer.cumulative_length
            if cache_write_fits(*caches, key_states, value_states):
                cache_write_fitted(*caches, key_states, value_states)
                return layer.keys, layer.values
        return self.cache.update(key_states, value_states, layer_idx, *args, **kwargs)


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
def static_update_computes(layer_class) -> bool:
    """Whether layer_class is a static cache layer (not sliding) whose update, once initialized, computes
    cache_write_reference and returns its caches (equal tensors on a CPU probe; a probe that fails says no)."""
    if getattr(layer_class, "is_sliding", True):
        return False
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.device("cpu"):
            layer = layer_class(max_cache_len=5)
            layer.update(*(torch.randn(2, 3, 2, 4, generator=generator) for _ in range(2)))
            expected = [t.clone() for t in (layer.keys, layer.values, layer.cumulative_length)]
            for tokens in (1, 2):
                new = [torch.randn(2, 3, tokens, 4, generator=generator) for _ in range(2)]
                returned = layer.update(*new)
                cache_write_reference(*expected, *new)
                if not (returned[0] is layer.keys and returned[1] is layer.values and all(
                        torch.equal(a, b) for a, b in zip((layer.keys, layer.values, layer.cumulative_length),
                                                          expected))):
                    return False
    except Exception:  # noqa: BLE001 (another transformers release's layer: its own update runs)
        return False
    return True


@functools.cache
def layer_computes(layer_class, config_class) -> bool:
    """Whether layer_class computes pre_norm_layer: equal bits on a CPU probe of a small layer of config_class in
    eval mode, fp32, random weights and rotary tables; a probe that fails says no."""
    generator = torch.Generator().manual_seed(0)
    try:
        config = config_class(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=8, num_hidden_layers=1, attn_implementation="eager")
        with torch.device("cpu"), torch.no_grad():
            layer = layer_class(config, 0).eval()
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            x = torch.randn(2, 3, 16, generator=generator)
            rotary = tuple(torch.randn(2, 3, 8, generator=generator) for _ in range(2))

            def reference_add_norm(attended, residual):
                summed = residual + attended
                return layer.post_attention_layernorm(summed), summed
            expected = layer_class.forward(layer, x, position_embeddings=rotary)
            return torch.equal(pre_norm_layer(layer, reference_add_norm, x, position_embeddings=rotary), expected)
    except Exception:  # noqa: BLE001 (another transformers release's layer: it keeps its own forward)
        return False


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


def fuse_norms_and_rotary(model, layers):
    """Installs the kernels' forwards on the model's norms (those of its family's DECODER_FUSIONS entry), on
    the attention of its decoder `layers` (rotary) and on those layers (pre_norm_layer), where the running
    transformers computes what the entry says. Returns the family's entry, None for a family without one (nothing
    installed)."""
    fusion = DECODER_FUSIONS.get(model.config.model_type)
    if fusion is None:
        return None
    norms = [m for m in model.modules() if type(m).__name__ == fusion.norm]
    if norms and norm_computes(type(norms[0]), fusion.form, fusion.eps):
        for norm in norms:
            norm.forward = functools.partial(norm_forward, norm, fusion.form, fusion.eps)
        for layer in layers:
            config = getattr(layer.self_attn, "config", None)
            if config is not None and layer_computes(type(layer), type(config)):
                layer.forward = functools.partial(layer_forward, layer, functools.partial(
                    add_norm, layer.post_attention_layernorm, fusion.form, fusion.eps))
    for layer in layers:
        forward = inspect.unwrap(type(layer.self_attn).forward)
        apply_rotary = forward.__globals__.get("apply_rotary_pos_emb")
        if apply_rotary is not None and rotary_computes(apply_rotary):
            layer.self_attn.forward = functools.partial(attention_forward, layer.self_attn)
    return fusion


def unfuse_norms_and_rotary(model) -> None:
    """Takes fuse_norms_and_rotary's forwards off again: every module runs its class's forward."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), "func", None) in (norm_forward, attention_forward, layer_forward):
            del module.forward
