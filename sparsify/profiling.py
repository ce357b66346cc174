"""Where a call's GPU time goes, per model component (MLP, attention, norm, LM head, other matmuls, the rest):
one call under torch.profiler with a profiler range around each component's module, each device activity
counted for the range around the op (or the driver call, for Triton's launcher) that launched it, and by its
kernel name outside any range; a component's time is the union of its kernels' intervals. `sparsify bench`
reports it beside each timing (docs/design.md says how it is measured)."""
from __future__ import annotations

import contextlib
import re

import torch

from .families import mlp_modules, spec_for


COMPONENTS = ("mlp", "attention", "norm", "lm_head", "matmul", "other")


RANGE = "sparsify::"  # prefix of the profiler ranges around modules


# CUDA runtime and driver launch calls (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch)
LAUNCH_CALL = re.compile(r"cu(da)?(Graph)?Launch")


# kernel-name fragments (lower case) of each component, for kernels outside a module range; first match wins
KERNEL_NAMES = (("mlp", ("gate_pack", "twell", "compact_list", "relu")),
                ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
                ("norm", ("rsqrt", "norm")),
                ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "small_linear")))


def module_component(class_name: str, *, is_mlp: bool = False, is_head: bool = False) -> str | None:
    """The component a module's range counts for (None: not a component; its kernels fall to its parent's
    range, or to their names)."""
    if is_mlp:
        return "mlp"
    if is_head:
        return "lm_head"
    if "Attention" in class_name:
        return "attention"
    return "norm" if "Norm" in class_name else None


def kernel_component(name: str) -> str:
    """The component of a kernel that ran outside any module range, by its name (KERNEL_NAMES)."""
    name = name.lower()
    return next((component for component, parts in KERNEL_NAMES if any(p in name for p in parts)), "other")


def busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def component_split(kernels) -> dict:
    """GPU ms per component: the union of its kernels' intervals, so that kernels of one component that
    overlap (the MLP's two programmatic dependent launches) count once; and gpu_busy_ms, the union of all.
    `kernels`: (range, name, start_us, end_us) of every device activity, range None where no module range
    launched it (it then counts by its name); a range "mlp.3" counts for "mlp"."""
    intervals = {component: [] for component in COMPONENTS}
    for label, name, start, end in kernels:
        intervals[label.partition(".")[0] if label else kernel_component(name)].append((start, end))
    return {**{f"{c}_ms": busy_us(spans) / 1e3 for c, spans in intervals.items()},
            "gpu_busy_ms": busy_us((start, end) for _, _, start, end in kernels) / 1e3}


def mlp_layers(kernels, events) -> list[dict]:
    """Per layer, its MLP's GPU ms (the union of the kernels launched in its range "mlp.<layer>") and host ms
    (the CPU time spent inside that range: issuing the call), summed over the layer's calls."""
    from torch.autograd import DeviceType

    gpu, host = {}, {}
    for label, _, start, end in kernels:
        if label and label.startswith("mlp."):
            gpu.setdefault(int(label.partition(".")[2]), []).append((start, end))
    for e in events:
        if e.name.startswith(RANGE + "mlp.") and e.device_type == DeviceType.CPU:
            layer = int(e.name.rpartition(".")[2])
            host[layer] = host.get(layer, 0.0) + e.time_range.end - e.time_range.start
    return [{"gpu_ms": busy_us(gpu.get(i, [])) / 1e3, "host_ms": host.get(i, 0.0) / 1e3}
            for i in range(max([*gpu, *host], default=-1) + 1)]


@contextlib.contextmanager
def module_ranges(model):
    """Profiler ranges RANGE + component around the model's MLP ("mlp.<layer>"), attention, norm and LM-head
    modules (not around modules inside one already covered). Eager calls only: the hooks would be traced by
    a compile."""
    if model is None:
        yield
        return
    mlps = {id(m): i for i, m in enumerate(mlp_modules(model, spec_for(model.config)))}
    head = model.get_output_embeddings()
    open_ranges, handles, covered = [], [], []

    def enter(label):
        def hook(module, args):
            open_ranges.append(torch.profiler.record_function(label))
            open_ranges[-1].__enter__()
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in covered):
            continue
        component = module_component(type(module).__name__, is_mlp=id(module) in mlps, is_head=module is head)
        if component:
            covered.append(name + ".")
            label = f"mlp.{mlps[id(module)]}" if component == "mlp" else component
            handles += [module.register_forward_pre_hook(enter(RANGE + label)), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _range_of(event) -> str | None:
    while event is not None:
        if event.name.startswith(RANGE):
            return event.name[len(RANGE):]
        event = event.cpu_parent
    return None


def profile_split(fn, model=None) -> dict:
    """component_split of one fn() call under torch.profiler, with module_ranges(model) (None: none), and
    then also each layer's MLP GPU and host time (mlp_layers)."""
    from torch.profiler import ProfilerActivity, profile

    with module_ranges(model), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = device_kernels(events, launch_ids(prof))
    split = component_split(kernels)
    return split if model is None else {**split, "mlp_layers": mlp_layers(kernels, events)}


def launch_ids(prof) -> dict:
    """(start_us, end_us) of each device activity -> correlation id of the op that launched it, from the
    profiler's raw events: FunctionEvent carries that id itself only from torch 2.12."""
    from torch.autograd import DeviceType

    results = prof.profiler.kineto_results
    start = results.trace_start_ns()
    return {((e.start_ns() - start) / 1e3, (e.end_ns() - start) / 1e3): e.linked_correlation_id()
            for e in results.events() if e.device_type() != DeviceType.CPU}


def device_kernels(events, launches: dict | None = None) -> list:
    """(component, name, start_us, end_us) of each device activity among profiler `events`: the component of
    the module range around the op that launched it (linked by correlation id: the event's own, else
    `launches` from launch_ids), None outside any range. Triton's launcher calls the driver outside any op,
    so its kernels link to no op; they share their own id with that launch call (cuLaunchKernelEx), which
    sits in the range."""
    from torch.autograd import DeviceType

    def launch_id(e):
        linked = getattr(e, "linked_correlation_id", None)
        return linked if linked is not None else (launches or {}).get((e.time_range.start, e.time_range.end))

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    launched_by = {e.id: e for e in cpu if e.kernels}
    # API calls only: an op and an API call may carry the same number
    api_calls = {e.id: e for e in cpu if LAUNCH_CALL.match(e.name)}
    return [(_range_of(launched_by.get(launch_id(e)) or api_calls.get(e.id)), e.name, e.time_range.start,
             e.time_range.end)
            for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(RANGE)]


def breakdown(fn, wall_s: float, model=None) -> dict:
    """Where one call goes: profile_split of fn() (module ranges of `model`), beside `wall_s`, the call's
    median time without the profiler (the graph step: its replay's), and gpu_idle_ms = wall - busy."""
    split = profile_split(fn, model)
    return {"wall_ms": 1e3 * wall_s, **split, "gpu_idle_ms": max(1e3 * wall_s - split["gpu_busy_ms"], 0.0)}
