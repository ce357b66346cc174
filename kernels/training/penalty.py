"""The sparsity penalty of the hidden activations h of a ReLU-gated MLP, per unit of a token: L1, |h|, or with
eps > 0 the log penalty, eps * log(1 + |h| / eps), as steep as L1 for |h| small against eps and far flatter for
the large activations that carry a layer's output (its slope 1 / (1 + |h| / eps)). Here in PyTorch (what the
reference and the dense training path compute) and as Triton helpers, which the hybrid kernels call with eps
a runtime float and LOG (eps > 0) a compile-time flag, so that L1's code is what it is without the option."""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the hybrid block runs the reference's math instead
    triton = None


def penalty(a: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """The penalty of each |h| = a >= 0: a itself (L1), or with eps > 0 eps * log(1 + a / eps)."""
    return eps * torch.log1p(a / eps) if eps else a


def sparsity_penalty(h: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """The penalty of h [..., I]: the mean over tokens of the sum over units, in at least fp32 (under bf16 a sum
    over thousands of units loses the small terms)."""
    dtype = torch.promote_types(h.dtype, torch.float32)
    a = h.abs()
    if eps:
        a = penalty(a.to(dtype), eps)
    return a.sum(-1, dtype=dtype).mean()


if triton is not None:

    @triton.jit
    def penalty_of(a, eps, LOG: tl.constexpr):
        """`penalty` of |h| = a (fp32)."""
        if LOG:
            a = eps * tl.log(1.0 + a / eps)
        return a

    @triton.jit
    def penalty_grad(h, c, eps, LOG: tl.constexpr):
        """c times the penalty's derivative in h (fp32): c sign(h), divided by 1 + |h| / eps with LOG."""
        d = c * tl.where(h > 0.0, 1.0, tl.where(h < 0.0, -1.0, 0.0))
        if LOG:
            d = d / (1.0 + tl.abs(h) / eps)
        return d
else:
    penalty_of = penalty_grad = None  # no kernel exists to call them
