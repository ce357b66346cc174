"""Which path a call of a sparse layer takes, the kernels or the dense block, beyond its plan's token windows:
- `short_prefill`: a prefill of several tokens a sequence, up to the decode rows, runs dense, eager or
  captured (its sequences' first tokens are heavy, which the decode path pays for at full weight reads).
- `eager_dense`: an eager call whose dense block takes less GPU time than EAGER_MIN_DENSE_S is bound by the
  kernels' launch time and runs dense. Decode steps replay graphs; captured and traced calls pay no host time.
- `ActivityRouter`: longer eager calls count their heavy rows and a sample of the other rows' active units
  (gated_mlp's four-element `overflow` counter, copied to the host as the GPU gets there; the host waits for it
  only after AHEAD more calls); when the cost model predicts a loss, the next PROBE_EVERY calls run dense, then
  the kernels measure again.
"""
from functools import lru_cache

import torch

from .cost_model import dense_time, twell_time
from .format import decode_rows

# Eager calls take the kernels only where the dense block's predicted GPU time reaches this: the geometric
# middle between the largest eager call measured host-bound and the smallest measured faster than dense, as
# the planner's windows are placed
EAGER_MIN_DENSE_S = 0.92e-3


def eager(x: torch.Tensor) -> bool:
    """Whether a call pays its launches' host time: not traced, not captured into a CUDA graph."""
    return not torch.compiler.is_compiling() and not (x.is_cuda and torch.cuda.is_current_stream_capturing())


@lru_cache(maxsize=1024)  # at every eager call of every layer: the cost model once per shape
def eager_dense(tokens: int, d: int, width: int) -> bool:
    """Whether an eager call of `tokens` tokens (not a replayed decode step) runs dense for its host time."""
    return dense_time(d, width, tokens) < EAGER_MIN_DENSE_S


def short_prefill(shape: torch.Size, d: int, width: int) -> bool:
    """Whether a call of this input shape is a prefill (several tokens a sequence) short enough for the decode
    path, where it runs dense (static shapes: under torch.compile a guard, not a graph break)."""
    return len(shape) >= 3 and shape[-2] > 1 and shape[:-1].numel() <= decode_rows(d, width)


class ActivityRouter:
    """Per layer and device: whether its next eager batched call takes the kernels (`overflow_counter` returns
    the counter to pass as gated_mlp's `overflow`) or runs dense (it returns None). A layer that moves to
    another device starts a new one."""

    WINDOW = 2  # batched kernel calls counted together
    # kernel calls issued while a window's count travels, after which the host waits for it: a host running
    # far ahead of the GPU (long calls) would otherwise issue many calls on the kernels before a verdict of
    # "dense" lands. The wait costs the GPU nothing while the calls queued behind the window keep it busy.
    AHEAD = 2
    # dense calls before the kernels measure again: a stream that stays heavy pays for each measuring window
    # (WINDOW kernel calls, and those issued while the count travels) once in this many calls
    PROBE_EVERY = 256

    def __init__(self, d: int, width: int, mean_active: float, device: torch.device):
        self.d, self.width, self.mean_active, self.device = d, width, mean_active, device
        self.counter, self.tokens, self.calls = None, 0, 0
        # (tokens, calls) of a window whose count is on its way to self.host; meanwhile self.calls counts the
        # kernel calls issued since it was sent
        self.landing = None
        self.host = self.event = None  # made once: a pinned allocation can synchronize the device
        self.dense_left = 0

    def overflow_counter(self, x: torch.Tensor, tokens: int):
        self._read_landed()
        if self.dense_left:
            self.dense_left -= 1
            return None
        if self.counter is None:  # overflowing pairs, sampled rows' units, those rows, heavy rows
            self.counter = torch.zeros(4, dtype=torch.int64, device=x.device)
        self.tokens += tokens
        self.calls += 1
        return self.counter

    def after_kernel_call(self):
        """Sends a full window's count toward the host (once the previous one has been read)."""
        if self.calls < self.WINDOW or self.landing is not None:
            return
        if self.host is None:
            cuda = self.counter.is_cuda
            self.host = torch.empty(4, dtype=torch.int64, pin_memory=cuda)
            self.event = torch.cuda.Event() if cuda else None
        self.host.copy_(self.counter, non_blocking=True)  # on the current stream of the counter's device
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
        self.landing = (self.tokens, self.calls)
        self.counter, self.tokens, self.calls = None, 0, 0

    def _read_landed(self):
        if self.landing is None:
            return
        if self.event is not None and not self.event.query():
            if self.calls < self.AHEAD:
                return
            self.event.synchronize()
        tokens, calls = self.landing
        self.landing = None
        _, units, rows, heavy = self.host.tolist()
        if self.loses(heavy / tokens, tokens / calls, units / rows if rows else self.mean_active):
            self.dense_left = self.PROBE_EVERY

    def loses(self, heavy_share: float, tokens: float, mean_active: float) -> bool:
        """Whether calls of `tokens` tokens with this share of heavy rows, whose other rows have `mean_active`
        units, are predicted slower than dense."""
        tokens = max(1, round(tokens))
        heavy_rows = round(heavy_share * tokens)
        return twell_time(mean_active, self.d, self.width, tokens, heavy_rows=heavy_rows) > \
            dense_time(self.d, self.width, tokens)
