"""benchmarks/decode_attention_bench.py: a failed check fails the run (CPU: the rows stubbed); attention and write
rows timed and checked on a GPU."""
import json

import pytest
import torch

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_attention_bench.py")


@pytest.mark.parametrize("failing", ["attention", "write"])
def test_a_failed_check_fails_the_run(bench, monkeypatch, tmp_path, failing):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "no GPU")
    monkeypatch.setattr(bench, "bench_row", lambda name, h, hkv, b, length, valid: dict(
        model=name, B=b, L=length, served=True, sdpa_us=2.0, kernel_us=1.0, speedup=2.0, err_sdpa=1e-3, err_kernel=1e-3,
        ok=not (failing == "attention" and b == 8 and length == 4096)))
    monkeypatch.setattr(bench, "write_row", lambda b, h, q: dict(
        B=b, H=h, Q=q, transformers_us=8.0, kernel_us=3.0, speedup=8 / 3, ok=not (failing == "write" and q == 4)))
    assert bench.main(["--json", str(tmp_path / "out.json")]) == 1
    result = json.loads((tmp_path / "out.json").read_text())
    assert len(result["rows"]) == len(bench.HEADS) * len(bench.CACHES) and len(result["writes"]) == len(bench.WRITES)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (32, 8)])
def test_decode_attention_bench_row_on_gpu(bench, monkeypatch, heads, kv_heads):
    monkeypatch.setattr(bench, "COPY_BYTES", 16 << 20)
    row = bench.bench_row("test", heads, kv_heads, 2, 300, 100)
    assert row["ok"] and row["speedup"] == pytest.approx(row["sdpa_us"] / row["kernel_us"])


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,queries", [(2, 16, 1), (1, 8, 300)])
def test_cache_write_bench_row_on_gpu(bench, batch, heads, queries):
    row = bench.write_row(batch, heads, queries)
    assert row["ok"] and row["speedup"] == pytest.approx(row["transformers_us"] / row["kernel_us"])
