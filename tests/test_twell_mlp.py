"""Non-gated TwELL block down(relu(up(x))) against its fp32 reference (interpreter on CPU, bf16 on GPU): the
inference kernels' non-gated options, which no product calls (the families are gated)."""
import math
import sys

import pytest
import torch

import twell
import twell.gated_mlp  # noqa: F401  (the module, beside the function of the same name)
from twell.reference import tile_counts

gm = sys.modules["twell.gated_mlp"]

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def mlp(x, up_weight, down_weight, *, tile=128, compression=8, precision="default", overflow=None):
    """down(relu(up(x))) through the gated block's launches, with up deciding activity and no up product."""
    return gm.forward(x, up_weight, None, down_weight, tile, compression, precision, overflow)


def mlp_reference(x, up_weight, down_weight):
    """fp32 reference of the block, returned in x's dtype."""
    return (torch.relu(x.float() @ up_weight.float().t()) @ down_weight.float().t()).to(x.dtype)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def weights(d, i, dtype):
    up = torch.randn(i, d, device=DEV) / math.sqrt(d)
    up[:, 0] = -1.5  # with x[:, 0] = 1: about 7% of the units fire
    down = torch.randn(d, i, device=DEV) / math.sqrt(i)
    return up.to(dtype), down.to(dtype)


@pytest.mark.parametrize("m,d,i,dtype", [(4, 40, 90, torch.float32), (70, 17, 48, torch.float16)])
def test_mlp_matches_reference(m, d, i, dtype):
    up, down = weights(d, i, dtype)
    x = torch.randn(m, d, device=DEV)
    x[:, 0] = 1.0
    x[1, 0] = -40.0  # a fully dense row: every tile overflows
    x[2, 0] = 40.0  # an empty row
    x = x.to(dtype)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = mlp(x, up, down, tile=16, compression=4, overflow=overflow)
    assert rel_err(out, mlp_reference(x.float(), up, down)) < (1e-5 if dtype == torch.float32 else 3e-3)
    assert (out[2] == 0).all()
    assert overflow.item() >= math.ceil(i / 16)


@pytest.mark.parametrize("m,dtype,precision", [(1, torch.float32, "highest"), (3, torch.float16, "default")])
def test_mlp_decode_dense_rows(m, dtype, precision):
    """Decode sizes: fully dense rows overflow every (64-wide) tile; their output comes from partial rows."""
    torch.manual_seed(m)
    up, down = weights(37, 151, dtype)
    x = torch.randn(m, 37, device=DEV)
    x[:, 0] = 1.0
    x[0, 0] = -40.0  # every unit active
    x = x.to(dtype)
    g = x.float() @ up.float().t()
    per_tile = tile_counts(g, 64)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = mlp(x, up, down, tile=128, compression=8, precision=precision, overflow=overflow)
    assert rel_err(out, mlp_reference(x.float(), up, down)) < (1e-5 if dtype == torch.float32 else 3e-3)
    assert overflow.item() == (per_tile > 8).sum().item() >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4096])
def test_gpu_mlp_bf16(m):
    up, down = weights(2048, 5632, torch.bfloat16)
    x = torch.randn(m, 2048, device=DEV)
    x[:, 0] = 1.0
    x = x.bfloat16()
    ref = mlp_reference(x.float(), up, down).float()
    dense = torch.relu(x @ up.t()) @ down.t()
    err = rel_err(mlp(x, up, twell.prepare_down(down), compression=2), ref)
    assert err < max(1.25 * rel_err(dense, ref), 4e-3)
