"""benchmarks/bench_inference.py on CPU: what --resume keeps of a run cut short and what it measures again
(the measurements themselves need a GPU)."""
import json
from pathlib import Path

import pytest
import torch

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_inference.py")


@pytest.fixture(scope="module")
def robust():
    return load_benchmark("inference_robustness.py")


def robust_row(robust, m, k, heavy, plan_k=None):
    d, i = robust.ROBUST_SHAPE
    return dict(D=d, I=i, M=m, k=k, plan_k=plan_k or k, heavy_rows=heavy, eager_speedup=1.0)


def write(path, result):
    path.write_text(json.dumps(result))
    return str(path)


def test_robustness_cells_leave_out_the_rows_already_measured(bench, robust, tmp_path):
    # heavy rows at 64 tokens: none, one (the count and the shares that round below one), 5%, 25%, all
    assert robust.robustness_cells(29, None, (1, 64)) == [(1, 0), (1, 1), (64, 0), (64, 1), (64, 3), (64, 16),
                                                         (64, 64)]
    earlier = [robust_row(robust, 1, 29, 0), robust_row(robust, 64, 29, 3),
               robust_row(robust, 64, 29, 16, plan_k=98)]  # planned from other inputs: another cell
    result, done = bench.resumed(write(tmp_path / "r.json", dict(runtime="this tree", rows=earlier)),
                                 robust.ROBUST_KEY)
    assert result["rows"] == earlier and len(done) == 3
    assert robust.robustness_cells(29, None, (1, 64), done) == [(1, 1), (64, 0), (64, 1), (64, 16), (64, 64)]
    assert robust.robustness_cells(29, 98, (64,), done) == [(64, 0), (64, 1), (64, 3), (64, 64)]
    assert bench.resumed(str(tmp_path / "none.json"), robust.ROBUST_KEY) == (None, set())


def test_resume_continues_a_robustness_run(bench, robust, tmp_path, monkeypatch):
    earlier = [robust_row(robust, 1, 29, 0), robust_row(robust, 64, 29, 3)]
    path = write(tmp_path / "r.json", dict(runtime="this tree", rows=earlier))
    seen = {}

    def robustness(folder, plan_k, tokens, actives, done, fp8_gate, fp8_up_down):
        seen.update(done=done, tokens=tokens, actives=actives, fp8_gate=fp8_gate, fp8_up_down=fp8_up_down)
        yield robust_row(robust, 64, 29, 0)

    monkeypatch.setattr(bench, "robustness", robustness)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "no GPU")
    bench.main(["--robustness", "--tokens", "1", "64", "--active", "29", "--json", path, "--resume"])
    assert seen == dict(done={tuple(row[key] for key in robust.ROBUST_KEY) for row in earlier}, tokens=[1, 64],
                        actives=[29], fp8_gate=False, fp8_up_down=False)
    result = json.loads(Path(path).read_text())
    assert result["rows"] == earlier + [robust_row(robust, 64, 29, 0)] and result["runtime"] == "this tree"


@pytest.mark.parametrize("args,result,message", [
    (["--robustness"], dict(rows=[dict(D=2048, I=5632, M=1, k=29, tile=128, compression=8)]),
     "is not a --robustness result"),
    ([], dict(runtime="this tree", rows=[dict(D=2048, I=5632, M=1, k=29, plan_k=29, heavy_rows=0)]),
     "is not a grid result"),
    (["--robustness"], dict(runtime="/elsewhere/ckpt", rows=[]), "timed the runtime '/elsewhere/ckpt'"),
    (["--robustness", "--fp8-gate"], dict(runtime="this tree", rows=[]), "ran without --fp8-gate"),
    (["--robustness"], dict(runtime="this tree", fp8_gate=True, rows=[]), "ran with --fp8-gate"),
    (["--robustness", "--fp8-up-down"], dict(runtime="this tree", rows=[]), "ran without --fp8-up-down"),
    (["--robustness", "--fp8-gate"], dict(runtime="this tree", fp8_gate=True, fp8_up_down=True, rows=[]),
     "ran with --fp8-up-down"),
    (["--heavy-block"], dict(rows=[]), "continues the block grid and --robustness only"),
    (["--decode-rules"], dict(rows=[]), "continues the block grid and --robustness only"),  # all rules: no names
])
def test_resume_refuses_another_run(bench, tmp_path, capsys, args, result, message):
    path = write(tmp_path / "r.json", result)
    with pytest.raises(SystemExit):
        bench.main([*args, "--json", path, "--resume"])
    assert message in capsys.readouterr().err


def test_call_path_names_where_the_layer_runs_dense(robust):
    """A robustness row names the path of each timing, as the layer's forward takes it: dense outside the plan's
    token windows, the kernels inside them (on CPU through the interpreter)."""
    modeling = robust.runtime()
    original = torch.nn.Module()
    for name, shape in (("gate_proj", (96, 32)), ("up_proj", (96, 32)), ("down_proj", (32, 96))):
        original.add_module(name, torch.nn.Linear(shape[1], shape[0], bias=False))
    plan = modeling.LayerPlan("sparse", 64, 8, ((1, 64),))
    mlp = modeling.TwellGatedMLP(original, robust.LAYOUT, plan)
    kernel, eager = modeling.gated_mlp, modeling.eager
    for shape, captured, path in (((1, 8, 32), False, "kernels"), ((1, 8, 32), True, "kernels"),
                                  ((1, 100, 32), False, "dense"), ((65, 1, 32), True, "dense")):
        x = torch.randn(shape)
        taken, out = robust.call_path(modeling, mlp, x, captured=captured)
        assert taken == path and torch.allclose(out, mlp._dense(x), rtol=1e-4, atol=1e-5), (shape, captured)
    assert modeling.gated_mlp is kernel and modeling.eager is eager  # restored
