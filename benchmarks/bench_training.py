"""Training benchmark of the gated MLP block (forward + backward, sparsity penalty included: L1, or the log
penalty with --l1-eps): hybrid TwELL against the dense bf16 PyTorch block (gate and up as one fused matmul), by
the method of docs/performance.md.

    python benchmarks/bench_training.py [--tokens 16384] [--l1-eps 0.1] [--json out.json] [--e2e] [--profile]

Each block step is timed eagerly (host launch costs included) and as a CUDA-graph replay (GPU alone).

--e2e adds training steps of a 1.5B-shape Llama (dense vs hybrid MLPs; --e2e-batch: sequences a step,
tokens/s, peak memory and the memory the forward adds; --e2e-fused: both again with the decoder's RMSNorms and rotary
embedding on twell's differentiable kernels as sparsify's trainer runs them, the first step's loss and gradient norm
beside the unfused ones), the LM head and the cross-entropy in chunks of tokens as the trainer computes them
(--e2e-whole-loss: the whole logits, as transformers computes the loss); --profile prints per-kernel times of the
k=29 step and the host issue time against the wall time.

Synthetic sparsity: bias channel x[:, 0] = 1, gate[:, 0] set for k active units a row; "uneven" adds
skew * N(0, 1) per unit to gate[:, 0], the skew chosen so that the mean lands near the target.
Checks out and all gradients against an fp32 reference in the same run; measures the saved
activation memory (bytes saved for backward, inputs and weights excluded) of both blocks.
"""
import argparse
import gc
import json
import math
import platform
import sys
import weakref

import torch
import triton
from triton.testing import do_bench

from sparsify.train.head_loss import chunked_head
from twell.decoder import fuse_norms_and_rotary
from twell.training import ell, hybrid_gated_mlp, sparsity_penalty
from twell.training import hot_units as busiest_units
from twell.training.blocks import GPU_BLOCKS

L1_COEFF = 2e-5
# --e2e's runs: the MLPs dense or hybrid, then with --e2e-fused the same with the norms and rotary on the kernels
E2E_MODES = ("dense", "hybrid", "dense_fused", "hybrid_fused")


def make_inputs(M, D, I, k, uneven_mean=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    normal = torch.distributions.Normal(0.0, 1.0)
    x = torch.randn(M, D, device="cuda", generator=gen)
    x[:, 0] = 1.0
    gate = torch.randn(I, D, device="cuda", generator=gen) / D**0.5
    b0 = normal.icdf(torch.tensor(k / I)).item()
    gate[:, 0] = b0
    if uneven_mean is not None:  # E[Phi(b0 + s z)] = Phi(b0 / sqrt(1 + s^2)) = uneven_mean / I
        skew = math.sqrt((b0 / normal.icdf(torch.tensor(uneven_mean / I)).item()) ** 2 - 1)
        gate[:, 0] += skew * torch.randn(I, device="cuda", generator=gen)
    up = torch.randn(I, D, device="cuda", generator=gen) / D**0.5
    down = torch.randn(D, I, device="cuda", generator=gen) / k**0.5
    dout = torch.randn(M, D, device="cuda", generator=gen)
    return x, gate, up, down, dout


def dense_block(x, gate_up, down, I, eps):
    g, u = (x @ gate_up.t()).split(I, dim=-1)
    h = torch.relu(g) * u
    return h @ down.t(), sparsity_penalty(h, eps)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def saved_bytes(fn, inputs):
    ptrs = {t.data_ptr() for t in inputs}
    total = [0]

    def pack(t):
        if t.data_ptr() not in ptrs:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = fn()
    return total[0], res


def graphed(step, grads):
    """The step captured in a CUDA graph (neither block synchronizes with the host): a replay costs the
    GPU time alone, as in a training loop whose host runs ahead of the GPU."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in grads:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in grads:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def bench_case(name, M, D, I, k, uneven_mean, E, hot=False, eps=0.0):
    """One block case; with `hot`, units that fire in more than twell.training.HOT_RATE of the tokens (from
    a first forward's counts, as a training loop would take them from an earlier step) run as dense
    columns."""
    x32, gate32, up32, down32, dout32 = make_inputs(M, D, I, k, uneven_mean)
    bf = torch.bfloat16
    x = x32.to(bf).requires_grad_()
    gate, up, down = (w.to(bf).requires_grad_() for w in (gate32, up32, down32))
    gate_up = torch.cat([gate, up]).detach().requires_grad_()
    dout = dout32.to(bf)
    coef = torch.tensor(L1_COEFF, device="cuda")
    with torch.no_grad():
        hot_units = busiest_units(hybrid_gated_mlp(x, gate, up, down, max_nnz=E)[1].fired, M) if hot else None

    def dense_step(x=x, gate_up=gate_up, down=down):
        out, l1 = dense_block(x, gate_up, down, I, eps)
        torch.autograd.backward([out, l1], [dout, coef])

    def hybrid_step(x=x, gate=gate, up=up, down=down):
        out, st = hybrid_gated_mlp(x, gate, up, down, max_nnz=E, hot_units=hot_units, l1_eps=eps)
        torch.autograd.backward([out, st.l1], [dout, coef])

    def hybrid_fwd():
        return hybrid_gated_mlp(x, gate, up, down, max_nnz=E, hot_units=hot_units, l1_eps=eps)

    # correctness against fp32 (tf32 off), same inputs
    torch.backends.cuda.matmul.allow_tf32 = False
    leaves32 = [t.clone().requires_grad_() for t in (x32, gate32, up32, down32)]
    out_r, l1_r = dense_block(leaves32[0], torch.cat(leaves32[1:3]), leaves32[3], I, eps)
    torch.autograd.backward([out_r, l1_r], [dout32, coef])
    ref = [out_r, l1_r] + [t.grad for t in leaves32]
    del leaves32
    errs = {}
    for label, fn in (("dense_bf16", lambda: dense_block(x, gate_up, down, I, eps)), ("hybrid", hybrid_fwd)):
        for t in (x, gate, up, down, gate_up):
            t.grad = None
        out, l1 = fn()
        l1 = l1.l1 if label == "hybrid" else l1
        torch.autograd.backward([out, l1], [dout, coef])
        dg, du = (gate.grad, up.grad) if label == "hybrid" else gate_up.grad.split(I)
        errs[label] = dict(out=rel(out, ref[0]), l1=rel(l1, ref[1]), dx=rel(x.grad, ref[2]),
                           d_gate=rel(dg, ref[3]), d_up=rel(du, ref[4]), d_down=rel(down.grad, ref[5]))
    del ref, out_r, l1_r

    with torch.no_grad():
        _, st = hybrid_fwd()
        cnt = (x @ gate.t() > 0).sum(1)
    stats = dict(mean_active=st.active.item(), max_active=int(cnt.max()), backup_rows=int(st.backup_rows),
                 hot_units=0 if hot_units is None else hot_units.numel(),
                 dead_units=int((st.fired == 0).sum()))

    mem = {}
    for label, fn in (("dense", lambda: dense_block(x, gate_up, down, I, eps)), ("hybrid", hybrid_fwd)):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        nbytes, res = saved_bytes(fn, [x, gate, up, down, gate_up])
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        out_bytes = res[0].numel() * res[0].element_size()
        mem[label] = dict(saved_bytes=nbytes, alloc_after_fwd_minus_out=after - before - out_bytes)
        del res
    mem["saved_ratio"] = mem["hybrid"]["saved_bytes"] / mem["dense"]["saved_bytes"]

    grads = [x, gate, up, down, gate_up]
    times = {}
    for label, fn in (("dense", dense_step), ("hybrid", hybrid_step)):
        times[label] = do_bench(fn, warmup=100, rep=500, grad_to_none=grads, return_mode="median")
    # graphs capture steps on fresh leaves: autograd nodes of the eager steps above stay cached on theirs
    fresh = [t.detach().clone().requires_grad_() for t in grads]
    for label, fn in (("dense", lambda: dense_step(fresh[0], fresh[4], fresh[3])),
                      ("hybrid", lambda: hybrid_step(*fresh[:4]))):
        times[label + "_graph"] = do_bench(graphed(fn, fresh), warmup=50, rep=300, return_mode="median")
    times["hybrid_fwd_only"] = do_bench(hybrid_fwd, warmup=50, rep=300, return_mode="median")
    times["gate_matmul"] = do_bench(lambda: x @ gate.t(), warmup=50, rep=300, return_mode="median")
    times["speedup"] = times["dense"] / times["hybrid"]
    times["speedup_graph"] = times["dense_graph"] / times["hybrid_graph"]
    return dict(name=name, tokens=M, D=D, I=I, k=k, uneven_mean_target=uneven_mean, max_nnz=E, l1_eps=eps,
                stats=stats, rel_err=errs, memory=mem, ms=times)


def breakdown(M, D, I, k, uneven_mean, E):
    """Median ms of each stage of the hybrid block on its own (where the time goes)."""
    bf = torch.bfloat16
    x, gate, up, down, dout = (t.to(bf) for t in make_inputs(M, D, I, k, uneven_mean))
    bench = lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    pre = x @ gate.t()
    idx, g, nnz, _, _ = ell.pack_ell(pre, E)
    u = torch.empty(M, E, device="cuda")
    downT = down.t().contiguous()
    c = torch.full((1,), 1e-3, device="cuda")
    ell.sddmm(x, up, idx, nnz, g, u, backward=False)
    dgp, du = ell.sddmm(dout, downT, idx, nnz, g, u, backward=True, c=c)
    csc = ell.build_csc(idx, I, GPU_BLOCKS["SEG"])
    variants = {}

    def variant(name, fn, **blocks):
        saved = dict(GPU_BLOCKS)
        GPU_BLOCKS.update(blocks)
        variants[name] = bench(fn)
        GPU_BLOCKS.update(saved)

    for bn, seg in ((4, 256), (8, 512)):
        csc_v = ell.build_csc(idx, I, seg)
        variant(f"wgrad_gate_up_N{bn}_SEG{seg}", lambda: ell.wgrad(csc_v, E, dgp, du, x, mode=ell.A_AND_B),
                BLOCK_N=bn, SEG=seg)
    o1, o2 = torch.empty_like(dgp), torch.empty_like(du)
    return dict(
        **variants,
        gate_matmul=bench(lambda: x @ gate.t()),
        pack=bench(lambda: ell.pack_ell(pre, E)),
        transpose_down_torch=bench(lambda: down.t().contiguous()),
        transpose_down=bench(lambda: ell.transpose(down, bf)),
        sddmm_fwd=bench(lambda: ell.sddmm(x, up, idx, nnz, g, u, backward=False)),
        spmm_fwd=bench(lambda: ell.spmm(idx, nnz, g, downT, u, dtype=bf)),
        sddmm_bwd=bench(lambda: ell.sddmm(dout, downT, idx, nnz, g, u, backward=True, c=c)),
        spmm_bwd_dx=bench(lambda: ell.spmm(idx, nnz, dgp, gate, du, up, dtype=bf)),
        csc_sort=bench(lambda: ell.build_csc(idx, I, GPU_BLOCKS["SEG"])),
        wgrad_gate_up=bench(lambda: ell.wgrad(csc, E, dgp, du, x, mode=ell.A_AND_B)),
        wgrad_down=bench(lambda: ell.wgrad(csc, E, g, u, dout, mode=ell.A_TIMES_B)),
        wgrad_down_fused_dh=bench(lambda: ell.wgrad(csc, E, g, u, dout, mode=ell.DH_GATED, w=downT, c=c, o1=o1, o2=o2)),
    )


def bias_channel_llama(cfg, k, mode, records):
    """A bf16 Llama of `cfg` with random weights whose MLPs (dense or hybrid) see input channel 0 set to 1 and
    gate[:, 0] set for about k active units, each appending its (L1, active units) to `records`."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    b0 = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(k / cfg.intermediate_size)).item()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)

    def forward(self, x):
        x = torch.cat([torch.ones_like(x[..., :1]), x[..., 1:]], -1)  # the bias channel
        if mode == "hybrid":
            out, st = hybrid_gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
            records.append((st.l1, st.active))
            return out
        h = torch.relu(F.linear(x, self.gate_proj.weight)) * F.linear(x, self.up_proj.weight)
        records.append((h.abs().sum(-1).mean(), (h != 0).sum(-1).float().mean().detach()))
        return F.linear(h, self.down_proj.weight)

    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.normal_(0, cfg.hidden_size ** -0.5)[:, 0] = b0
            layer.mlp.forward = forward.__get__(layer.mlp)
    return model


def e2e(k=29, batch=4, seq=2048, steps=5, fused=False, chunked=True):
    """Training steps (forward, backward, AdamW) of a 1.5B-shape Llama (28 layers, D 2048, I 5632,
    vocabulary 49152, random weights), dense MLPs vs hybrid, and with `fused` both again with the norms and rotary
    on twell's kernels; sparsity controlled by a bias channel (MLP input channel 0 set to 1, gate[:, 0] set for k
    active units); the cross-entropy `chunked` as the trainer computes it (sparsify.train.head_loss), else from the
    whole logits. Tokens/s and peak memory; the first step's loss and gradient norm, equal up to rounding within
    dense and within hybrid."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=49152,
                      max_position_embeddings=seq, hidden_act="relu")
    cfg._attn_implementation = "sdpa"
    results = {}
    for mode in E2E_MODES if fused else E2E_MODES[:2]:
        # each MLP call's (L1, active units) of the current step, in layer order; the step empties it, so no
        # tensor of an autograd graph outlives its step (the graph would keep the parameters alive)
        records, first = [], {}
        model = bias_channel_llama(cfg, k, mode.removesuffix("_fused"), records)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        ids = torch.randint(0, 49152, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

        def step(memory=None):
            """One training step; returns each MLP's active units (detached), averaged after the timing."""
            records.clear()
            if chunked:
                with chunked_head(model, ids):
                    loss = model(input_ids=ids).logits[0]  # [CE, KL] in place of the logits
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss = loss + L1_COEFF * torch.stack([l1 for l1, _ in records]).mean()
            if memory is not None:  # what the forward keeps for the backward, beside weights and optimizer
                memory.append(torch.cuda.memory_allocated())
            loss.backward()
            if not first:
                first.update(loss=loss.item(), grad_norm=torch.nn.utils.get_total_norm(
                    [p.grad for p in model.parameters()]).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            active = [a for _, a in records]
            records.clear()
            return active

        if mode.endswith("_fused"):  # as sparsify's trainer installs them (config.fused_decoder)
            fuse_norms_and_rotary(model, model.model.layers)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        before, memory = torch.cuda.memory_allocated(), []
        step(memory)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            active = step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / steps
        results[mode] = dict(step_ms=ms, tokens_per_s=batch * seq / ms * 1e3,
                             peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                             after_forward_gib=(memory[0] - before) / 2**30,
                             mean_active=torch.stack(active).mean().item(), first_step=first)
        print(mode, json.dumps(results[mode]), flush=True)
        weight = weakref.ref(model.model.embed_tokens.weight)
        del model, opt, step, ids
        gc.collect()  # each MLP's bound forward refers back to it: the model is freed by the cycle collector
        torch.cuda.empty_cache()
        if weight() is not None:  # the next mode's peak would count these weights
            raise RuntimeError(f"{mode}: the model's weights are still allocated after the run")
    results["speedup"] = results["dense"]["step_ms"] / results["hybrid"]["step_ms"]
    if fused:  # against dense as transformers runs it, and against dense with the same norm and rotary kernels
        results["speedup_fused"] = results["dense"]["step_ms"] / results["hybrid_fused"]["step_ms"]
        results["speedup_both_fused"] = results["dense_fused"]["step_ms"] / results["hybrid_fused"]["step_ms"]
    return dict(model="llama 28 x (2048, 5632), vocab 49152", batch=batch, seq=seq, k=k, steps=steps,
                loss="chunked" if chunked else "whole logits", **results)


def profile(M, D, I, k, E, steps=10):
    """Per-kernel GPU time of the hybrid step inside the real step (torch.profiler)."""
    x, gate, up, down, dout = make_inputs(M, D, I, k)
    x = x.to(torch.bfloat16).requires_grad_()
    gate, up, down = (w.to(torch.bfloat16).requires_grad_() for w in (gate, up, down))
    dout = dout.to(torch.bfloat16)
    coef = torch.tensor(L1_COEFF, device="cuda")

    def step():
        for t in (x, gate, up, down):
            t.grad = None
        out, st = hybrid_gated_mlp(x, gate, up, down, max_nnz=E)
        torch.autograd.backward([out, st.l1], [dout, coef])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    import time
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    kernels_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps
    print(f"host time to issue a step {1e3 * (t1 - t0) / steps:.3f} ms; "
          f"wall a step {1e3 * (t2 - t0) / steps:.3f} ms; GPU kernels a step {kernels_ms:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--D", type=int, default=2048)
    ap.add_argument("--I", type=int, default=5632)
    ap.add_argument("--max-nnz", type=int, default=128)
    ap.add_argument("--l1-eps", type=float, default=0.0,
                    help="the block cases' penalty: 0 for L1, > 0 for the log penalty with this eps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--e2e", action="store_true", help="also time training steps of a 1.5B-shape model")
    ap.add_argument("--e2e-batch", type=int, nargs="+", default=[4], help="sequences of 2048 tokens a step (--e2e)")
    ap.add_argument("--e2e-fused", action="store_true",
                    help="--e2e also with the norms and rotary on twell's kernels (dense and hybrid MLPs)")
    ap.add_argument("--e2e-whole-loss", action="store_true",
                    help="--e2e with the cross-entropy of the whole logits (transformers') instead of the chunked head")
    ap.add_argument("--skip-block", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only print per-kernel times of the k=29 step")
    args = ap.parse_args()
    if min(args.e2e_batch) < 1:
        ap.error(f"--e2e-batch must be positive, got {args.e2e_batch}")
    if not 0 <= args.l1_eps < math.inf:
        ap.error(f"--l1-eps must be a finite number >= 0 (0: L1), got {args.l1_eps}")
    if args.profile:
        return profile(args.tokens, args.D, args.I, 29, args.max_nnz)
    cases = [("k29", 29, None, False), ("k29_hot", 29, None, True), ("k98_uneven", 29, 98, False),
             ("k98_uneven_hot", 29, 98, True)]
    results = []
    for n, k, um, hot in ([] if args.skip_block else cases):
        r = bench_case(n, args.tokens, args.D, args.I, k, um, args.max_nnz, hot, args.l1_eps)
        if not hot:
            r["breakdown_ms"] = breakdown(args.tokens, args.D, args.I, k, um, args.max_nnz)
        print(n, json.dumps(r), flush=True)
        results.append(r)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), command="python " + " ".join(sys.argv), results=results)
    if args.e2e:
        doc["e2e"] = [e2e(batch=batch, fused=args.e2e_fused, chunked=not args.e2e_whole_loss)
                      for batch in args.e2e_batch]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"{'case':12} {'mean':>6} {'max':>5} {'bkp':>5} {'dense ms':>9} {'hybrid ms':>9} {'fwd ms':>7} "
          f"{'speedup':>7} {'graphed':>7} {'saved':>6} {'err out':>8} {'err dx':>8} {'err dW':>8} {'dense err':>9}")
    for r in results:
        e, s, t = r["rel_err"]["hybrid"], r["stats"], r["ms"]
        print(f"{r['name']:12} {s['mean_active']:6.1f} {s['max_active']:5d} {s['backup_rows']:5d} "
              f"{t['dense']:9.3f} {t['hybrid']:9.3f} {t['hybrid_fwd_only']:7.3f} {t['speedup']:7.2f} "
              f"{t['speedup_graph']:7.2f} "
              f"{r['memory']['saved_ratio']:6.3f} {e['out']:8.1e} {e['dx']:8.1e} "
              f"{max(e['d_gate'], e['d_up'], e['d_down']):8.1e} {r['rel_err']['dense_bf16']['out']:9.1e}")
    for run in doc.get("e2e", []):
        for mode in (mode for mode in E2E_MODES if mode in run):
            r = run[mode]
            print(f"e2e batch {run['batch']} ({run['loss']}) {mode:7} step {r['step_ms']:8.1f} ms  "
                  f"{r['tokens_per_s']:9.0f} tok/s  peak {r['peak_mem_gib']:6.2f} GiB  active {r['mean_active']:.1f}  "
                  f"first loss {r['first_step']['loss']:.5f} grad norm {r['first_step']['grad_norm']:.4f}")


if __name__ == "__main__":
    main()
