"""`bench_inference.py --robustness`: the layer exactly as a converted checkpoint's modeling file runs it (its
plan from sparsify.plan, its token windows and router, TwellGatedMLP.forward) against the same layer planned
dense, on a grid of token counts x heavy rows x mean active units (robustness())."""
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

from synthetic_mlp import LAYERS, make_heavy, make_layer, make_x, per_layer_us, print_row, reference, rel_err

ROBUST_KEY = ("D", "I", "M", "k", "plan_k", "heavy_rows")  # what identifies a --robustness row (--resume)
RUNTIMES = []
LAYOUT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ROBUST_TOKENS = (1, 8, 64, 512, 2048, 4096, 16384, 65536)
ROBUST_HEAVY = (0, 1, 0.001, 0.01, 0.05, 0.25, 1.0)  # heavy rows: a count (0, 1) or a share of the tokens
ROBUST_ACTIVE = (10, 29, 98, 300)
ROBUST_SHAPE = (2048, 5632)  # D, I
CALIBRATION = (8, 1024)  # sequences x tokens the plan is measured on, each sequence's first token heavy


def runtime(folder=None):
    """The modeling file's module as a checkpoint loads it: the files an export writes (the modeling file,
    generation.py and the inference kernel files) side by side in one package (or those of `folder`, an
    exported checkpoint's), imported under a fresh name."""
    root = Path(tempfile.mkdtemp())
    package = root / f"twell_runtime_{len(RUNTIMES)}"
    package.mkdir()
    if folder:
        files = [file for file in Path(folder).glob("*.py") if file.name != "__init__.py"]
    else:  # the files an export writes beside each other
        from sparsify import export

        files = export.shipped_files(export.kernel_dir())
    for file in files:
        shutil.copy2(file, package / file.name)
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(root))
    RUNTIMES.append(root)
    return importlib.import_module(f"{package.name}.modeling_twell")



def planned_mlp(modeling, w, d, i, k, plan_k, heavy_units):
    """The layer as a converted checkpoint runs it: TwellGatedMLP over w's weights with the plan that
    sparsify.plan makes from this layer's statistics on calibration inputs of plan_k active units a token
    and one heavy token (heavy_units) at each sequence's start; and the same weights planned dense."""
    from sparsify.measure import LayerCounter
    from sparsify.plan import plan_layer

    def projections():  # each module its own copies (the kernels' load-time layout changes the down weight's)
        original = torch.nn.Module()
        for name, weight in (("gate_proj", w["gate"]), ("up_proj", w["up"]), ("down_proj", w["down"])):
            linear = torch.nn.Linear(*weight.shape[::-1], bias=False, device="cuda", dtype=weight.dtype)
            linear.weight.data = weight.clone()
            original.add_module(name, linear)
        return original

    sequences, length = CALIBRATION
    x = make_x(sequences * length, d)
    make_heavy(x, slice(None), plan_k, i, k)
    make_heavy(x, slice(None, None, length), heavy_units, i, k)
    counter = LayerCounter()
    counter((x @ w["gate"].t()).view(sequences, length, i))
    plan = modeling.LayerPlan.from_json(plan_layer(counter.result(sequences), hidden_size=d).to_json())
    return (modeling.TwellGatedMLP(projections(), LAYOUT, plan),
            modeling.TwellGatedMLP(projections(), LAYOUT, modeling.LayerPlan()))


def plan_of(mlp) -> dict:
    """The setting a TwellGatedMLP runs, as config.json writes it (less the planner's statistics)."""
    return {key: value for key, value in mlp.plan.to_json().items() if key != "stats"}


@torch.no_grad()
def call_path(modeling, mlp, x, captured: bool) -> tuple[str, torch.Tensor]:
    """The path the modeling file's layer `mlp` takes for x ("kernels" where its forward calls gated_mlp, else
    "dense") and its output; `captured`: as inside a CUDA-graph capture. Cells whose two columns both run dense
    compare the same math."""
    calls, kernel, eager = [], modeling.gated_mlp, modeling.eager
    modeling.gated_mlp = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    if captured:
        modeling.eager = lambda x: False
    try:
        out = mlp(x)
    finally:
        modeling.gated_mlp, modeling.eager = kernel, eager
    return "kernels" if calls else "dense", out


def paired_ms(first, second, rounds=3):
    """do_bench medians of two calls measured alternately, the median of each over the rounds (drift between
    the two measurements cancels)."""
    times = [[], []]
    for _ in range(rounds):
        for fn, samples in zip((first, second), times):
            samples.append(do_bench(fn, return_mode="median"))
    return tuple(sorted(samples)[rounds // 2] for samples in times)


def mean_ms(fn, calls):
    """Mean milliseconds of `calls` consecutive calls (CUDA events around them all)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def heavy_count(m, heavy):
    return min(m, heavy if isinstance(heavy, int) else max(1, round(heavy * m)))


def robustness_cells(k, plan_k, tokens, done=()):
    """The cells (M, heavy rows) of --robustness at k active units, in the order measured, less those whose
    ROBUST_KEY is in `done`."""
    d, i = ROBUST_SHAPE
    cells = [(m, heavy) for m in tokens for heavy in dict.fromkeys(heavy_count(m, h) if h else 0 for h in ROBUST_HEAVY)]
    return [(m, heavy) for m, heavy in cells if (d, i, m, k, plan_k or k, heavy) not in done]


def robustness(folder=None, plan_k=None, tokens=ROBUST_TOKENS, actives=ROBUST_ACTIVE, done=(), fp8_gate=False,
               fp8_up_down=False):
    """The layer exactly as the modeling file runs it (its plan and token windows, TwellGatedMLP.forward)
    against the same layer planned dense, in one process, on a grid: tokens x heavy rows (half the units
    active, like a sequence's first token; at the start of the call and then evenly spread) x mean active
    units, D 2048 / I 5632. Eager calls (do_bench medians, dense and TwELL alternately: host time counts
    where it exceeds the GPU's; each cell starts the layer's ActivityRouter afresh, and batched cells also
    time one whole cycle of it, its measuring windows included), and up to 64 tokens also CUDA-graph
    replays over LAYERS layer copies, of the call as one sequence's prefill [1, M, D] ("graph") and as a
    decode step of M sequences [M, 1, D] ("step_graph"). The plan is made from each layer's
    own activity (or `plan_k` units, when the inputs are more or less active than the calibration); each
    cell checks the output against fp32 in the same run and names the layer's path for each timing
    (`eager_path`, `graph_path`, `step_graph_path`: call_path). With `fp8_gate` the kernel layers run as a
    checkpoint's use_fp8_gate() makes them (err_twell then holds the fp8 gate's error too), with `fp8_up_down` as
    its use_fp8_up_down() does (likewise). Yields the rows of the cells whose ROBUST_KEY is not in `done` (a run
    cut short: its rows' keys)."""
    d, i = ROBUST_SHAPE
    modeling = runtime(folder)
    for k in actives:
        cells = robustness_cells(k, plan_k, tokens, done)
        if not cells:
            continue
        layers = [make_layer(d, i, k) for _ in range(LAYERS)]
        mlps = [planned_mlp(modeling, w, d, i, k, plan_k or k, i // 2) for w in layers]
        for sparse_mlp, _ in mlps:
            sparse_mlp.use_fp8_gate(fp8_gate)
            sparse_mlp.use_fp8_up_down(fp8_up_down)
        plan = plan_of(mlps[0][0])
        for m, heavy in cells:
            x = make_x(m, d)
            at = torch.linspace(0, m - 1, heavy).round().long().tolist() if heavy else []
            if heavy:
                make_heavy(x, at, i // 2, i, k)
            sparse_mlp, dense_mlp = mlps[0]
            with torch.no_grad():
                check = slice(0, min(m, 4096))
                ref = reference(x[check], layers[0])
                sparse_mlp.router = None  # each cell from a fresh router: none carries over another's verdict
                eager_path, out = call_path(modeling, sparse_mlp, x[None], captured=False)
                out = out[0]
                row = dict(D=d, I=i, M=m, k=k, plan_k=plan_k or k, heavy_rows=heavy, plan=plan, eager_path=eager_path,
                           active=(x[check].float() @ layers[0]["gate"].float().t() > 0).sum(1).float().mean().item(),
                           err_twell=rel_err(out[check], ref),
                           err_dense=rel_err(dense_mlp(x[None])[0][check], ref))
                sparse_mlp.router = None
                row["eager_dense_ms"], row["eager_twell_ms"] = paired_ms(lambda: dense_mlp(x[None]),
                                                                         lambda: sparse_mlp(x[None]))
                row["eager_speedup"] = row["eager_dense_ms"] / row["eager_twell_ms"]
                if sparse_mlp.router is not None:  # batched: a whole cycle of its router, probes included
                    calls = sparse_mlp.router.WINDOW + sparse_mlp.router.PROBE_EVERY
                    sparse_mlp.router = None
                    row["cycle_dense_ms"] = mean_ms(lambda: dense_mlp(x[None]), calls)
                    row["cycle_twell_ms"] = mean_ms(lambda: sparse_mlp(x[None]), calls)
                    row["cycle_speedup"] = row["cycle_dense_ms"] / row["cycle_twell_ms"]
                if m <= 64:  # as one sequence's prefill, and as a decode step of m sequences
                    for name, shaped in (("graph", x[None]), ("step_graph", x[:, None]))[:1 if m == 1 else 2]:
                        row[f"{name}_path"] = call_path(modeling, sparse_mlp, shaped, captured=True)[0]
                        row[f"{name}_dense_us"] = per_layer_us(lambda pair: pair[1](shaped), mlps)
                        row[f"{name}_twell_us"] = per_layer_us(lambda pair: pair[0](shaped), mlps)
                        row[f"{name}_speedup"] = row[f"{name}_dense_us"] / row[f"{name}_twell_us"]
            print_row(row)
            yield row
        del layers, mlps
