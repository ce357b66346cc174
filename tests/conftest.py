"""Test setup, before anything imports torch, triton or transformers: without a GPU, Triton kernels run under
the interpreter on CPU tensors and tests marked `gpu` are skipped; remote code loaded by the tests goes
to a fresh modules cache (not the user's, removed at the end), and nothing tries to reach the Hub. CPU ops run on one
thread (the processes the tests start too): the tiny models' ops are too small to share, and on a machine whose other
cores are busy every multi-threaded op would wait for a thread that is not running."""
import os
import shutil
import tempfile

MODULES_CACHE = os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="sparsify-hf-modules-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_unconfigure(config):
    shutil.rmtree(MODULES_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # Triton reads TRITON_INTERPRET when a kernel is defined, so a test cannot switch it on for itself
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    skips = {"gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
             "interpreter": None if interpreter else pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (CPU)")}
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)
