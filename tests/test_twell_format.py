"""TwELL packing (Triton kernel; interpreter on CPU) against the PyTorch reference."""
import os
import subprocess
import sys

import pytest
import torch

import twell
from twell.format import slots
from twell.reference import pack_reference


def activation(m, width, density):
    """ReLU-like activation with a chosen density, plus an empty row and a fully dense row."""
    g = torch.rand(m, width) - (1 - density)
    g[0] = -1.0
    g[-1] = torch.rand(width) + 0.1
    return torch.relu(g)


def valid_mask(tw):
    return torch.arange(tw.values.shape[2]) < tw.counts.clamp(max=tw.values.shape[2])[..., None]


@pytest.mark.parametrize("m,width,tile,compression,dtype", [
    (5, 100, 32, 8, torch.float32),
    (19, 64, 16, 2, torch.float32),
    (9, 300, 128, 8, torch.float16),  # 16-bit values: the epilogue's one-min-a-slot keys
    (6, 80, 64, 4, torch.bfloat16),
])
def test_pack_matches_reference(m, width, tile, compression, dtype):
    g = activation(m, width, 0.1).to(dtype)
    tw, ref = twell.pack(g, tile, compression), pack_reference(g, tile, compression)
    assert torch.equal(tw.counts, ref.counts)
    valid = valid_mask(ref)
    assert torch.equal(tw.indices[valid], ref.indices[valid])
    assert torch.equal(tw.values[valid], ref.values[valid])
    # the dense row overflows every full tile, the empty row has no entries
    assert (ref.counts[-1, :width // tile] > slots(tile, compression)).all() and (ref.counts[0] == 0).all()


def test_unpack_roundtrip_and_reads_only_valid_slots():
    g = activation(7, 50, 0.05)[1:-1]  # no overflow at these slots
    tw = pack_reference(g, 16, 2)
    assert (tw.counts <= 8).all()
    poisoned = tw._replace(values=torch.where(valid_mask(tw), tw.values, float("nan")),
                           indices=torch.where(valid_mask(tw), tw.indices, 10**6))
    assert torch.equal(twell.unpack(poisoned), g)


def test_slot_count_validation():
    assert slots(256, 8) == 32 and slots(16, 32) == 1
    with pytest.raises(ValueError):
        slots(100, 8)


def test_package_runs_without_triton():
    """Without triton (CPU-only installs) the package imports and falls back to the reference path."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, twell\n"
        "x, g, u, d = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)\n"
        "g[:, 0] = 5.0; x[:, 0] = 1.0\n"  # every unit active: the one tile of each row overflows
        "ov = torch.zeros(1, dtype=torch.int64)\n"
        "out = twell.gated_mlp(x, g, u, d, tile=16, compression=8, overflow=ov)\n"
        "assert torch.allclose(out, twell.gated_mlp_reference(x, g, u, d), atol=1e-5)\n"
        "assert ov.item() == 3, ov\n"
        "assert torch.equal(twell.unpack(twell.pack(torch.relu(x), 16, 2)), torch.relu(x))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
