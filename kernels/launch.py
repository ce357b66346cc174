"""What the kernels' launchers share: a kernel bound to a fixed grid and scalar arguments (`Launch`), the device's
SM count, whether it takes programmatic dependent launches (and the options and first step of a kernel launched so:
`pdl_options`, `pdl_start`), and the custom ops through which traced calls
(torch.compile, export, dispatch modes) reach the kernels (`custom_op`)."""
import functools
import hashlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference path
    tl = None


class Launch:
    """One kernel at a fixed grid, scalar arguments and options; called with its tensor arguments. The
    first call goes through Triton's JIT (compiling if needed); later ones run the compiled kernel directly,
    skipping Triton's per-call argument binding and cache lookup. That is sound while the tensors keep the
    dtypes and 16-byte alignment of the first call, which gated_mlp's launch-cache key guarantees: Triton
    specializes on nothing else (the scalars are fixed here)."""

    def __init__(self, kernel, grid, scalars: dict, options: dict, extra=None):
        names = kernel.arg_names[len(kernel.arg_names) - len(scalars):]
        self.kernel, self.grid, self.options, self.extra = kernel, grid, options, extra
        self.scalars = tuple(scalars[n] for n in names)  # tensors first, then these, in signature order
        self.run = None

    def __call__(self, *tensors):
        if self.extra is not None:  # arguments made from the tensors at each call (TMA descriptors, placeholders)
            tensors = tensors + self.extra(*tensors)
        if self.run is not None:
            self.run(*tensors, *self.scalars)
            return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.options)
        if compiled is not None:  # None under the interpreter
            self.run = compiled[self.grid]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (4 under the interpreter: a few programs, each taking several items)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.cache
def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and newer): a kernel is launched while the one before it runs and
    waits for it on the device, which hides its launch latency (the MLP's out kernel behind its gate kernel at
    decode; the decoder's kernels, pdl_options). Asked once a device: launchers ask at every call."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))  # Triton >= 3.4


def pdl_options(device: torch.device) -> dict:
    """Launch options of a kernel that starts with `pdl_start(PDL)`: where use_pdl, launched while the kernel before
    it in the stream still runs (its launch latency hidden), PDL set so that it waits for that kernel first."""
    return dict(PDL=True, launch_pdl=True) if use_pdl(device) else dict(PDL=False)


if tl is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """With PDL, a kernel's first step: wait for the kernel before it in the stream (its writes visible), then
        let the next one launch, which waits for this one in turn."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
else:
    pdl_start = None


# Each copy of these files (the installed package, each exported checkpoint's, possibly of other versions)
# registers ops of its own, named after its module: a copy loaded again reuses them
COPY = hashlib.sha1(__name__.encode()).hexdigest()[:10]


def op_name(name: str) -> str:
    """The name under torch.ops.twell of this copy's op `name` ("gated_mlp", "gated_mlp_overflow", "small_linear")."""
    return f"{name}_{COPY}"


def custom_op(name: str, body, schema: str, fake, mutates_args=()):
    """This copy's custom op twell::<op_name(name)> around `body` (inference only: no autograd), with its fake
    implementation `fake` (the outputs' shapes from the arguments')."""
    try:
        return getattr(torch.ops.twell, op_name(name)).default
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(f"twell::{op_name(name)}", body, schema=schema, mutates_args=mutates_args)
    op.register_fake(fake)
    return op
