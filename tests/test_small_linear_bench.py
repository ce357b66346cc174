"""benchmarks/small_linear_bench.py: its launch-settings sweep and failed checks on CPU (the timings need a GPU);
one row timed and checked on a GPU."""
import json

import pytest
import torch

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("small_linear_bench.py")


def test_sweep_sets_and_restores_the_launch_settings(bench, monkeypatch):
    """Each combination of SWEEP is in force during its rows (every block BN rows), the defaults after; a
    setting that fails to compile is kept as an error row."""
    names = ("BLOCK_N", "WIDE_BLOCK_N", "STEP_BYTES", "STAGES", "WARPS")
    defaults = {name: getattr(bench.MODULE, name) for name in names}
    seen = []

    def row(m, rows, k, bias, copies):
        seen.append(tuple(getattr(bench.MODULE, name) for name in names))
        if bench.MODULE.STAGES == 5 and bench.MODULE.BLOCK_N == 32:
            raise RuntimeError("out of resources")
        return dict(M=m, N=list(rows), K=k, ok=True)

    monkeypatch.setattr(bench, "row", row)
    results = bench.sweep_rows((64,), 32, False, copies=None)
    combinations = len(bench.SWEEP["BN"]) * len(bench.SWEEP["STEP_BYTES"]) * len(bench.SWEEP["STAGES"]) * len(
        bench.SWEEP["WARPS"])
    assert len(results) == len(seen) == combinations * len(bench.SWEEP_ROWS)
    assert all(block == wide for block, wide, *_ in seen)
    errors = [r for r in results if "error" in r]
    assert errors and all(r["STAGES"] == 5 and r["BN"] == 32 and "out of resources" in r["error"] for r in errors)
    assert {name: getattr(bench.MODULE, name) for name in defaults} == defaults
    assert set(bench.SWEEP_SHAPES) <= set(bench.shapes())


def _no_gpu(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "no GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "sm_count", lambda device: 132)
    monkeypatch.setattr(bench, "copies_of", lambda rows, k, bias: None)


def test_a_failed_check_fails_the_run(bench, monkeypatch, tmp_path):
    _no_gpu(bench, monkeypatch)
    monkeypatch.setattr(bench, "row", lambda m, rows, k, bias, copies: dict(M=m, N=list(rows), K=k,
                                                                          ok=not (m == 8 and k == 8960)))
    with pytest.raises(SystemExit) as exited:
        bench.main(["--json", str(tmp_path / "out.json")])
    assert exited.value.code == 1 and (tmp_path / "out.json").is_file()


def test_families_rows_say_where_the_modeling_file_launches_small_linear(bench, monkeypatch, tmp_path, capsys):
    _no_gpu(bench, monkeypatch)
    monkeypatch.setattr(bench, "row", lambda m, rows, k, bias, copies: dict(M=m, N=list(rows), K=k, ok=True,
                                                                          speedup=2.0 if len(rows) > 1 else 0.9))
    bench.main(["--families", "--json", str(tmp_path / "out.json")])
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert len(rows) == len(bench.FAMILY_SHAPES) * len(bench.FAMILY_ROWS)
    assert {r["model"] for r in rows} == set(bench.FAMILY_SHAPES)
    qwen3_o = {r["M"]: r["served"] for r in rows if r["model"] == "Qwen3-4B o"}
    assert qwen3_o == {1: True, 2: False, 4: False, 8: False, 16: False}  # 160 programs of 16 rows on 132 SMs
    assert all(r["served"] for r in rows if len(r["N"]) > 1)
    assert "where the modeling file launches it: 0.90x to 2.00x" in capsys.readouterr().out


@pytest.mark.gpu
def test_small_linear_bench_row_on_gpu(bench, monkeypatch):
    """A grouped row (q, k and v with biases) and a single one, timed and checked."""
    monkeypatch.setattr(bench, "COPY_BYTES", 16 << 20)
    grouped = bench.row(8, (256, 64, 64), 256, True, bench.copies_of((256, 64, 64), 256, True))
    assert grouped["ok"] and grouped["small_linear_grouped_us"] > 0 and grouped["small_linear_us"] > 0
    single = bench.row(1, (2048,), 2048, False, bench.copies_of((2048,), 2048, False))
    assert single["ok"] and single["speedup"] == pytest.approx(single["torch_us"] / single["small_linear_us"])
