"""CUDA graphs for decode-size calls made from eager code. An eager decode step is bound by its host time
(argument handling, allocations, kernel launches), which exceeds its GPU work; replayed as a CUDA graph, the
same call costs a copy in, one graph launch and a copy out.
`DecodeGraphs` keeps one graph per call signature: the function, x's shape and dtype, the device and current
stream, the tensor arguments' addresses, shapes, strides and dtypes, and the other arguments. A graph reads
its tensor arguments at the addresses it was captured with, so a tensor that moves gets a new signature, and
one changed in place is read as it is now. A signature is captured the second time it is seen; calls that a
graph cannot serve run directly (`DecodeGraphs.graphable`), and so do those of a signature whose capture
failed. The graphs of a stream share a memory pool, and one lock makes copy in, replay and copy out a single
step.
"""
import threading
import warnings
from collections import OrderedDict

import torch

# (device index, stream) -> [memory pool handle, side stream that captures, the pool's first graph]. PyTorch
# releases a pool when its last graph dies, and a later capture into it fails: the first graph is kept.
_POOLS = {}
# copy in, replay and copy out of any graph form one step: graphs of a stream share a pool, so one graph's
# replay may overwrite another's static output
_LOCK = threading.Lock()
# plain tensors and parameters: other subclasses (fake, functional, distributed tensors) trace or dispatch
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DIRECT = "direct"  # a signature whose capture failed: its calls run directly


class _Graph:
    """One captured call: x copied into its static input, the graph replayed, its output cloned."""

    def __init__(self, fn, x, args, kwargs):
        device = x.device
        current = torch.cuda.current_stream(device)
        key = (device.index, current.cuda_stream)
        if key not in _POOLS:
            _POOLS[key] = [torch.cuda.graph_pool_handle(), torch.cuda.Stream(device), None]
        pool, side, first = _POOLS[key]
        # normal tensors even under inference mode, so that later eager calls may copy into them
        with torch.inference_mode(False), torch.no_grad():
            self.x = _static_copy(x)
            self.graph = torch.cuda.CUDAGraph()
            side.wait_stream(current)  # capture needs a side stream; it starts after x is copied
            with torch.cuda.stream(side):
                self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self.out = fn(self.x, *args, **kwargs)
                except BaseException:
                    try:
                        self.graph.capture_end()
                    except RuntimeError:  # the capture is void already; the error that voided it follows
                        pass
                    raise
                self.graph.capture_end()
            current.wait_stream(side)
        if first is None:
            _POOLS[key][2] = self

    def __call__(self, x):
        self.x.copy_(x)
        self.graph.replay()
        return self.out.clone()


def _static_copy(x):
    """A fresh contiguous copy of x. The first, direct call of a signature runs on one too, so that it
    compiles exactly what the capture launches (kernels specialize on strides and alignment)."""
    copy = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    copy.copy_(x)
    return copy


def _signature(value):
    if isinstance(value, torch.Tensor):
        return value.data_ptr(), value.shape, value.stride(), value.dtype
    if isinstance(value, tuple):  # gated_mlp's gate_fp8
        return tuple(map(_signature, value))
    return value


class DecodeGraphs:
    """Calls `fn(x, *args, **kwargs)` through CUDA graphs where it can (see the module docstring).
    `rows`: the most rows (tokens, x.numel() // x.shape[-1]) a graphed call may have; `capacity`: graphs and
    once-seen signatures kept, least recently used dropped first."""

    def __init__(self, rows: int = 64, capacity: int = 32):
        self.rows, self.capacity = rows, capacity
        self._graphs = OrderedDict()  # signature -> _Graph, or None when seen once

    def graphable(self, x, *args) -> bool:
        flat = [b for a in args for b in (a if isinstance(a, tuple) else (a,))]  # gated_mlp's gate_fp8 a tuple
        tensors = (x, *(a for a in flat if isinstance(a, torch.Tensor)))
        return (x.is_cuda and 0 < x.numel() <= self.rows * x.shape[-1]
                and all(type(t) in _PLAIN for t in tensors)
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
                and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
                and not torch.cuda.is_current_stream_capturing())

    def __call__(self, fn, x, *args, **kwargs):
        if not self.graphable(x, *args, *kwargs.values()):
            return fn(x, *args, **kwargs)
        key = (fn, x.shape, x.dtype, x.device.index, torch._C._cuda_getCurrentRawStream(x.device.index),
               *map(_signature, args), *((k, _signature(v)) for k, v in sorted(kwargs.items())))
        with _LOCK:
            if key not in self._graphs:  # seen once: run directly, on an input laid out as the static one
                self._remember(key, None)
                return fn(_static_copy(x), *args, **kwargs)
            graph = self._graphs[key]
            if graph is None:
                try:
                    graph = _Graph(fn, x, args, kwargs)
                except RuntimeError as error:  # the call ran directly the first time: it still can
                    warnings.warn(f"twell: a decode call of shape {tuple(x.shape)} could not be captured as a CUDA "
                                  f"graph, so calls like it run directly ({error})", stacklevel=3)
                    graph = _DIRECT
                self._remember(key, graph)
            else:
                self._graphs.move_to_end(key)
            if graph is _DIRECT:
                return fn(x, *args, **kwargs)
            return graph(x)

    def _remember(self, key, graph):
        self._graphs[key] = graph
        self._graphs.move_to_end(key)
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)

    def __len__(self):
        """Graphs captured (once-seen signatures and failed captures not counted)."""
        return sum(g is not None and g is not _DIRECT for g in self._graphs.values())

    def __deepcopy__(self, memo):  # a copied model captures its own graphs (of its own weights)
        return DecodeGraphs(self.rows, self.capacity)

    def __getstate__(self):  # graphs are not picklable: a pickled model starts without them
        return dict(rows=self.rows, capacity=self.capacity)

    def __setstate__(self, state):
        self.__init__(**state)
