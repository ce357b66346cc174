"""Test setup, before anything imports triton or transformers: without a GPU, Triton kernels run under
the interpreter on CPU tensors and tests marked `gpu` are skipped; remote code loaded by the tests goes
to a fresh modules cache (not the user's), and nothing tries to reach the Hub."""
import os
import tempfile

os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="sparsify-hf-modules-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
