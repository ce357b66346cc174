"""Plain PyTorch references of what the runtime's kernels compute (the training kernels' are in
training/reference.py): the block, which every launch path's output matches (heavy rows included); each tile's
share of a row's output, which a decode gate program writes for an overflowing (row, tile) and the one-token
tile-out path for every tile; `forward_reference`, the path of CPU tensors without Triton, which adds to
`overflow` what the batched path's kernels add; `pack_reference` (the TwELL the gate kernels pack);
`rms_norm_reference` and `rotary_reference`, transformers' modules op for op (rms_norm.py, rotary.py), and
`rms_norm_add_reference`, a decoder layer's residual add and norm;
`small_linear_reference` (small_linear.py); `decode_attention_reference` (decode_attention.py);
`cache_write_reference` (cache_write.py), transformers' static cache update op for op. With the fp8 gate
(fp8_gate.py), `gate_values` gives g as the kernels compute it; with e4m3 up and down rows, `block_output` mixes
them as the kernels do."""
import torch

from .format import HEAVY_UNITS, UNIT_SAMPLE, TwELL, cdiv, decode_rows, slots
from .fp8_gate import gate_reference, up_down_reference


def gate_values(x2, gate, gate_fp8=None, tile=128, compression=8):
    """The gate's pre-activation g [M, I] in fp32 as a call computes it: x2 @ gate^T; with `gate_fp8` (a call
    of the batched path), the fp8 gate's (fp8_gate.gate_reference) where its packing gate pass serves, and
    x2 @ gate^T again where its dense fallbacks recompute a row or tile from the weights: the (row, tile)
    pairs beyond their slots and the heavy rows (more than HEAVY_UNITS units to walk, each overflowing tile
    counted whole: heavy.py)."""
    if gate_fp8 is None:
        return x2.float() @ gate.float().t()
    return with_fallbacks(x2, gate, gate_reference(x2, *gate_fp8), tile, compression)


def fallbacks(g, tile, compression):
    """[M, I] bool: the units of g (as the packing gate pass computes it) that the batched path's dense
    fallbacks compute from the weights: the (row, tile) pairs beyond their slots and the heavy rows (more than
    HEAVY_UNITS units to walk, each overflowing tile counted whole: heavy.py)."""
    per_tile = tile_counts(g, tile)
    over = per_tile > slots(tile, compression)
    heavy = per_tile.masked_fill(over, 0).sum(-1) + over.sum(-1) * tile > HEAVY_UNITS
    return (over | heavy[:, None]).repeat_interleave(tile, dim=1)[:, :g.shape[1]]


def with_fallbacks(x2, gate, g, tile, compression):
    """`g`, the fp8 gate's as the packing gate pass computes it, with x2 @ gate^T in the (row, tile) pairs that
    the batched path's dense fallbacks recompute (gate_values)."""
    return torch.where(fallbacks(g, tile, compression), x2.float() @ gate.float().t(), g)


def block_output(x2, g, up, down, packed=None, up_down_fp8=None, tile=128, compression=8):
    """The block's output in fp32 from its gate pre-activation g [M, I]. With `up_down_fp8` (a call of the
    batched path), the units the out kernel walks take up and down from the e4m3 copies, h in x's dtype
    between them, as the kernel rounds it; the fallbacks' units (from `packed`, g as the gate pass packs
    it) take up and down themselves."""
    xf = x2.float()
    h = torch.relu(g) * (xf @ up.float().t())
    if up_down_fp8 is None:
        return h @ down.float().t()
    walked = ~fallbacks(g if packed is None else packed, tile, compression)
    up_q, down_q = up_down_reference(up_down_fp8)
    h_q = (torch.relu(g) * (xf @ up_q.t())).to(x2.dtype).float()
    return torch.where(walked, 0.0, h) @ down.float().t() + torch.where(walked, h_q, 0.0) @ down_q.t()


def gated_mlp_reference(x, gate_weight, up_weight, down_weight, gate_fp8=None, tile=128, compression=8,
                        up_down_fp8=None):
    """fp32 reference of the block, returned in x's dtype (with `gate_fp8`: g as gate_values computes it; with
    `up_down_fp8`: up and down as block_output reads them)."""
    x2 = x.reshape(-1, x.shape[-1])
    g = gate_values(x2, gate_weight, gate_fp8, tile, compression)
    packed = None if gate_fp8 is None or up_down_fp8 is None else gate_reference(x2, *gate_fp8)
    out = block_output(x2, g, up_weight, down_weight, packed, up_down_fp8, tile, compression)
    return out.to(x.dtype).view(x.shape)


def tile_counts(g: torch.Tensor, tile: int) -> torch.Tensor:
    """Active units of each (row, tile) of g [M, I] cut into tiles of `tile` units: [M, NT]."""
    nt = cdiv(g.shape[1], tile)
    return torch.nn.functional.pad(g > 0, (0, nt * tile - g.shape[1])).view(g.shape[0], nt, tile).sum(-1)


def tile_shares(h: torch.Tensor, down: torch.Tensor, tile: int) -> torch.Tensor:
    """Each tile's share of each row's output, fp32 [M, NT, D]: h [M, I] over the tile's units times their
    columns of down [D, I]."""
    m, i = h.shape
    nt = cdiv(i, tile)
    h_tiles = torch.nn.functional.pad(h.float(), (0, nt * tile - i)).view(m, nt, tile)
    down_tiles = torch.nn.functional.pad(down.float(), (0, nt * tile - i)).view(-1, nt, tile)
    return torch.einsum("mtu,dtu->mtd", h_tiles, down_tiles)


def forward_reference(x, gate, up, down, tile, compression, overflow, gate_fp8=None, up_down_fp8=None):
    """gated_mlp's path for CPU tensors without the interpreter (g, up and down as the batched path reads
    them); counts overflow at the caller's tile."""
    width, d = gate.shape
    x2 = x.reshape(-1, d)
    xf = x2.float()
    packed = xf @ gate.float().t() if gate_fp8 is None else gate_reference(x2, *gate_fp8)  # g as the gate pass packs
    g = torch.relu(packed if gate_fp8 is None else with_fallbacks(x2, gate, packed, tile, compression))
    if overflow is not None:  # counted as the gate kernel packs them: from the fp8 gate's g where given
        per_tile = tile_counts(packed, tile)
        over = per_tile > slots(tile, compression)
        overflow[0] += over.sum().to(overflow.dtype)
        if overflow.numel() == 4 and x2.shape[0] > decode_rows(d, width):  # the batched path's activity counts
            units = per_tile.masked_fill(over, 0).sum(-1)
            heavy = units + over.sum(-1) * tile > HEAVY_UNITS
            sampled = (torch.arange(x2.shape[0]) % UNIT_SAMPLE == 0) & ~heavy
            overflow[1:] += torch.stack([units[sampled].sum(), sampled.sum(), heavy.sum()]).to(overflow.dtype)
    out = block_output(x2, g, up, down, packed, up_down_fp8, tile, compression)
    return out.to(x.dtype).view(x.shape)


def pack_reference(g: torch.Tensor, tile: int = 128, compression: int = 8) -> TwELL:
    """Plain PyTorch packing; slots beyond a tile's count are zero (values) and 0 (indices)."""
    m, width = g.shape
    s, nt = slots(tile, compression), cdiv(width, tile)
    gp = torch.nn.functional.pad(g, (0, nt * tile - width)).view(m, nt, tile)
    pos = gp > 0
    slot = pos.to(torch.int64).cumsum(-1) - 1
    keep = pos & (slot < s)
    cols = torch.arange(nt * tile, device=g.device).view(1, nt, tile).expand(m, nt, tile)
    # scatter the kept entries; everything else goes to a spare slot s that is cut off afterwards
    dst = torch.where(keep, slot, torch.full_like(slot, s))
    values = torch.zeros(m, nt, s + 1, dtype=g.dtype, device=g.device).scatter_(2, dst, gp * keep)
    indices = torch.zeros(m, nt, s + 1, dtype=torch.int64, device=g.device).scatter_(2, dst, cols * keep)
    return TwELL(values[..., :s].contiguous(), indices[..., :s].to(torch.int32).contiguous(),
                 pos.sum(-1).to(torch.int32), tile, width)


def rms_norm_reference(x, weight, eps: float, form: str = "llama"):
    """transformers' RMSNorm of `form`, op for op."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype) if form == "llama" else (xf * (1.0 + weight.float())).type_as(x)


def rms_norm_add_reference(x, residual, weight, eps: float, form: str = "llama"):
    """(rms_norm_reference(residual + x), residual + x): a pre-norm decoder layer's residual add and second norm."""
    summed = residual + x
    return rms_norm_reference(summed, weight, eps, form), summed


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin) (unsqueeze_dim 1), op for op."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def small_linear_reference(x, weight, bias=None):
    """x @ weight.T (+ bias) in fp32, cast to x's dtype."""
    out = x.float() @ weight.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def decode_attention_reference(query, key, value, mask=None, scale=None):
    """softmax(q k^T * scale where the mask allows) v in fp32, each query head over its key/value head (H / Hkv query
    heads a key/value head), the probabilities rounded to value's dtype as the kernel rounds them; [B, Q, H, D] in
    query's dtype, zeros for a row whose mask allows nothing."""
    b, h, q, d = query.shape
    group = h // key.shape[1]
    key = key.repeat_interleave(group, dim=1).float()
    value = value.repeat_interleave(group, dim=1)
    scores = query.float() @ key.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))
    total = p.sum(-1, keepdim=True)
    out = (p.to(value.dtype).float() @ value.float()) / torch.where(total == 0, 1.0, total)
    return out.transpose(1, 2).to(query.dtype)


def cache_write_reference(keys, values, count, key_states, value_states) -> None:
    """transformers' StaticLayer.update after its lazy initialization, op for op: key_states and value_states
    [B, H, Q, D] into the caches [B, H, L, D] at positions count .. count + Q - 1, count advanced by Q, in place."""
    positions = torch.arange(key_states.shape[-2], device=count.device) + count
    count.add_(key_states.shape[-2])
    keys.index_copy_(2, positions, key_states)
    values.index_copy_(2, positions, value_states)
