"""A decode step's keys and values written into a static KV cache at the cache's own count of positions, and the
count advanced, in one launch.

transformers' StaticLayer.update takes five launches a layer for it (an arange, its sum with the count, the count's
in-place add, an index_copy_ for the keys and one for the values), each a few microseconds at decode size. Here
each program copies COPY_ELEMENTS of the new (sequence, head, token) rows of keys and of values to position
count + token of their cache rows. The programs read the count through an atomic add of a ticket (TICKET, above any
count) that also tells each how many read it before; the last to read it takes the tickets off and adds the tokens,
so that no program reads a count that moved. reference.cache_write_reference is transformers' op order.

A write at or past the cache's end, where index_copy_ raises, writes no row: each (sequence, head)'s last cache
position is set to NaN instead, so that the attention over a full cache shows the fault in the step's output
rather than attending what the cache held."""
import torch

from .format import on_device, use_triton
from .launch import pdl_options, pdl_start
from .reference import cache_write_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None

COPY_ELEMENTS = 4096  # elements of new keys (and of values) a program copies: 32 a thread of 4 warps
TICKET = 1 << 40  # a program's share of the count while the programs read it: counts and programs stay below 2^23


def cache_write_fits(keys, values, count, key_states, value_states) -> bool:
    """Whether `cache_write` takes these arguments: caches keys [B, H, L, Dk] and values [B, H, L, Dv], new rows
    key_states [B, H, Q, Dk] and value_states [B, H, Q, Dv] in the caches' dtype, unit last strides, rows to write
    (B, H, Q > 0), Q <= L < 2^23, fewer than 2^31 rows and 2^23 programs; count an int64 scalar; one device."""
    if not all(t.dim() == 4 for t in (keys, values, key_states, value_states)) or count.shape != ():
        return False
    b, h, length, _ = keys.shape
    q = key_states.shape[2]
    return (values.shape[:3] == (b, h, length) and key_states.shape[:2] == (b, h)
            and value_states.shape[:3] == (b, h, q) and key_states.shape[3] == keys.shape[3]
            and value_states.shape[3] == values.shape[3] and b * h > 0 and 0 < q <= length
            and keys.dtype == values.dtype == key_states.dtype == value_states.dtype and count.dtype == torch.int64
            and length < 1 << 23 and b * h * q < 1 << 31
            and _programs(b * h * q, max(keys.shape[3], values.shape[3])) < 1 << 23
            and len({t.device for t in (keys, values, count, key_states, value_states)}) == 1
            and all(t.stride(-1) == 1 for t in (keys, values, key_states, value_states)))


def cache_write(keys, values, count, key_states, value_states) -> None:
    """Writes key_states and value_states into keys and values at positions count .. count + Q - 1 and adds Q to
    count, in place, as cache_write_reference (cache_write_fits says what it takes; past the caches' end, the module
    docstring). CPU tensors without the Triton interpreter take the reference."""
    if not cache_write_fits(keys, values, count, key_states, value_states):
        raise ValueError(f"cache_write: caches {tuple(keys.shape)} / {tuple(values.shape)} {keys.dtype}, new rows "
                         f"{tuple(key_states.shape)} / {tuple(value_states.shape)} {key_states.dtype}, count "
                         f"{tuple(count.shape)} {count.dtype} (caches [B, H, L, D], new rows [B, H, Q, D] of their "
                         f"dtype, 0 < Q <= L < 2^23; count an int64 scalar)")
    cache_write_fitted(keys, values, count, key_states, value_states)


def cache_write_fitted(keys, values, count, key_states, value_states) -> None:
    """`cache_write` of arguments that cache_write_fits has accepted, not checked again: for a caller that checks
    them itself to choose between the kernel and another path."""
    if not use_triton(keys):
        cache_write_reference(keys, values, count, key_states, value_states)
        return
    b, h, length, dk = keys.shape
    q, dv = key_states.shape[2], value_states.shape[3]
    rows, block_d = b * h * q, triton.next_power_of_2(max(dk, dv))
    with on_device(keys):
        _cache_write_kernel[(_programs(rows, block_d),)](
            key_states, value_states, keys, values, count, rows, h, q, dk, dv, length,
            *key_states.stride()[:3], *value_states.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
            TICKET=TICKET, BLOCK_R=_block_rows(block_d), BLOCK_D=block_d, num_warps=4, **pdl_options(keys.device))


def _block_rows(block_d: int) -> int:
    return max(1, COPY_ELEMENTS // block_d)


def _programs(rows: int, width: int) -> int:
    """Programs of a write of `rows` rows, the wider of keys and values `width` elements."""
    return -(-rows // _block_rows(1 << (width - 1).bit_length()))


if triton is not None:

    @triton.jit
    def _copy_rows(src_ptr, dst_ptr, r, start, H, Q, D, L, s_b, s_h, s_q, d_b, d_h, d_l, live_rows,
                   BLOCK_D: tl.constexpr):
        """Rows r (a column vector of (sequence, head, token) indices) of src to position start + token of dst, where
        the Q tokens fit inside the caches; else NaN to position L - 1 of each row's (sequence, head)."""
        d = tl.arange(0, BLOCK_D)[None, :]
        token = r % Q
        bh = r // Q
        b, h = bh // H, bh % H
        live = live_rows & (d < D)
        inside = token * 0 + start + Q <= L  # a column, as the interpreter makes an int mask of a bool scalar's &
        row = tl.load(src_ptr + b * s_b + h * s_h + token * s_q + d, mask=live & inside, other=float("nan"))
        position = tl.where(inside, start + token, L - 1)
        tl.store(dst_ptr + b * d_b + h * d_h + position * d_l + d, row, mask=live)

    @triton.jit
    def _cache_write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, count_ptr, rows, H, Q, DK, DV, L,
                            k_b, k_h, k_q, v_b, v_h, v_q, keys_b, keys_h, keys_l, values_b, values_h, values_l,
                            TICKET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """Program p: rows p * BLOCK_R .. at count .. count + Q - 1 (or, past the caches' end, NaN at their last
        position); the last program to read the count moves it to count + Q."""
        pdl_start(PDL)
        programs = tl.num_programs(0).to(tl.int64)
        ticket = tl.atomic_add(count_ptr, TICKET)  # the count, plus TICKET for each program that read it before
        start = ticket % TICKET
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]).to(tl.int64)
        live = r < rows
        _copy_rows(k_ptr, keys_ptr, r, start, H, Q, DK, L, k_b, k_h, k_q, keys_b, keys_h, keys_l, live, BLOCK_D)
        _copy_rows(v_ptr, values_ptr, r, start, H, Q, DV, L, v_b, v_h, v_q, values_b, values_h, values_l, live,
                   BLOCK_D)
        if ticket // TICKET == programs - 1:
            tl.atomic_add(count_ptr, Q - programs * TICKET)
