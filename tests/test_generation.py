"""generate_graphed (sparsify/remote/generation.py) against transformers' generate: greedy tokens, end of
sequence and padding, sampling filters, the kept loop, converted checkpoints, and the CUDA-graph replay."""
import copy
import logging
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig
from transformers.utils import logging as transformers_logging

from sparsify.export import export_checkpoint
from sparsify.families import spec_for
from sparsify.relufy import relufy
from sparsify.remote.generation import (CACHE_ROUND, CHECK_EVERY, Sampling, _compile_key, choose, compile_options,
                                        generate_graphed, graphed_call, padded_length)
from twell.layer_plan import ALL_TOKENS, LayerPlan, Mode

from helpers import decoder_unfused, tiny_input_ids, tiny_model

PLAN = [LayerPlan(Mode.SPARSE, 64, 2, ALL_TOKENS), LayerPlan()]
TRAINING = {"base_model": "someone/tiny-base", "tokens": 0, "steps": 0}


def reference(model, ids, new, **options):
    """transformers' own greedy generate (a converted checkpoint's generate would take the loop)."""
    if hasattr(model, "release_graphed"):
        options["graphed"] = False
    return model.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static", **options)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_match_generate(family):
    model, _ = tiny_model(family)
    ids = tiny_input_ids(2, 7)
    out = generate_graphed(model, ids, 20, eos_token_id=[])
    assert torch.equal(out, reference(model, ids, 20, eos_token_id=None, pad_token_id=0))
    loop = model._decode_loop.loop
    # the cache is rounded up (here to the model's 128 positions): other lengths fit it and reuse the step
    assert loop.max_len == min(CACHE_ROUND, model.config.max_position_embeddings)
    assert torch.equal(generate_graphed(model, ids, 20, eos_token_id=[]), out) and model._decode_loop.loop is loop
    longer = tiny_input_ids(2, 30)
    assert torch.equal(generate_graphed(model, longer, 9, eos_token_id=[]),
                       reference(model, longer, 9, eos_token_id=None, pad_token_id=0))
    assert model._decode_loop.loop is loop
    # a call beyond the cache (and past max_position_embeddings) gets a new loop of the length it needs
    assert generate_graphed(model, ids, 130, eos_token_id=[]).shape == (2, 137)
    assert model._decode_loop.loop is not loop and model._decode_loop.loop.max_len == 137
    assert copy.deepcopy(model)._decode_loop.loop is None  # a copy starts without the cache and graph
    loop = model._decode_loop.loop
    model.to(torch.float64).to(torch.float32)  # the weights move: a graph would read their old addresses
    assert torch.equal(generate_graphed(model, ids, 20, eos_token_id=[]), out) and model._decode_loop.loop is not loop


def test_padded_length():
    assert [padded_length(n) for n in (1, 16, 17, 100, 256, 257, 1100)] == [16, 16, 32, 128, 256, 512, 1280]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_left_padded_prompts_match_generate(family):
    model, _ = tiny_model(family)
    ids = tiny_input_ids(3, 8)
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :5] = 0  # prompts of 5, 8 and 3 tokens, padded on the left
    ids = ids.masked_fill(mask == 0, 0)
    out = generate_graphed(model, ids, 12, attention_mask=mask, eos_token_id=[])
    assert torch.equal(out, reference(model, ids, 12, attention_mask=mask, eos_token_id=None, pad_token_id=0))
    alone = generate_graphed(model, ids[2:, 5:], 12, eos_token_id=[])  # the 3-token prompt by itself
    assert torch.equal(out[2, 5:], alone[0])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        generate_graphed(model, ids, 4, attention_mask=mask.flip(-1))
    with pytest.raises(ValueError, match="attention_mask must be 0 / 1"):
        generate_graphed(model, ids, 4, attention_mask=mask[:, 1:])


def test_end_of_sequence_pads_and_stops_early():
    model, _ = tiny_model("llama")
    ids = tiny_input_ids(2, 6)
    free = generate_graphed(model, ids, 30, eos_token_id=[])
    eos = int(free[0, 6 + 2])  # the first sequence's third new token
    out = generate_graphed(model, ids, 30, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(out, reference(model, ids, 30, eos_token_id=eos, pad_token_id=1))  # ends where generate does
    first_end = [int((row[6:] == eos).nonzero()[0]) if (row[6:] == eos).any() else None for row in out]
    assert first_end[0] is not None and first_end[0] <= 2
    for row, end in zip(out, first_end):
        if end is not None:
            assert (row[6 + end + 1:] == 1).all()
    alone = generate_graphed(model, ids[:1], 30, eos_token_id=eos)  # ends on its end-of-sequence token
    assert alone.shape[1] == 6 + first_end[0] + 1 and alone[0, -1] == eos


def test_min_new_tokens_holds_back_the_end_of_sequence_as_generate_does():
    """min_new_tokens / min_length keep a stop id from being chosen before that many new tokens: the loop's
    tokens equal transformers' (greedy and top_k 1 sampling), which suppresses the id in the logits."""
    model, _ = tiny_model("llama")
    ids = tiny_input_ids(2, 6)
    eos = int(generate_graphed(model, ids, 30, eos_token_id=[])[0, 6 + 2])  # chosen third without a minimum
    for least in (1, 5, 30):
        out = generate_graphed(model, ids, 30, min_new_tokens=least, eos_token_id=eos, pad_token_id=1)
        expected = reference(model, ids, 30, min_new_tokens=least, eos_token_id=eos, pad_token_id=1)
        assert torch.equal(out, expected), least
        assert not (out[:, 6:6 + least] == eos).any()
    sampled = generate_graphed(model, ids, 30, min_new_tokens=5, do_sample=True, top_k=1, eos_token_id=eos,
                               pad_token_id=1)
    assert torch.equal(sampled, reference(model, ids, 30, min_new_tokens=5, eos_token_id=eos, pad_token_id=1))


class Recorder:
    """The streamer interface of transformers (put, end)."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value)

    def end(self):
        self.ended += 1


def test_streamer_gets_the_prompt_then_the_new_tokens():
    model, tokenizer = tiny_model("llama")
    ids = tiny_input_ids(1, 5)
    recorder = Recorder()
    out = generate_graphed(model, ids, 40, eos_token_id=[], streamer=recorder)
    assert torch.equal(recorder.puts[0], ids) and recorder.ended == 1
    assert [p.shape[1] for p in recorder.puts[1:]] == [CHECK_EVERY, CHECK_EVERY, 40 - 2 * CHECK_EVERY]
    assert torch.equal(torch.cat(recorder.puts, dim=1), out)
    eos = int(out[0, 5 + 20])  # ends within the second chunk: the streamer stops there too
    recorder = Recorder()
    out = generate_graphed(model, ids, 40, eos_token_id=eos, streamer=recorder)
    assert torch.equal(torch.cat(recorder.puts, dim=1), out) and out[0, -1] == eos
    from transformers import TextStreamer

    printed = []
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    streamer.on_finalized_text = lambda text, stream_end=False: printed.append(text)
    out = generate_graphed(model, ids, 40, eos_token_id=[], streamer=streamer)
    assert "".join(printed) == tokenizer.decode(out[0, 5:])


def sampling(temperature=1.0, top_k=0, top_p=1.0):
    settings = Sampling(top_k, top_p < 1, "cpu")
    settings.set(temperature, top_p)
    return settings


def test_sampling_filters():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = choose(logits, None)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(choose(logits, sampling(top_k=1)), greedy)
    assert torch.equal(choose(logits, sampling(top_p=1e-6)), greedy)  # the first token always stays
    top3 = logits.topk(3, dim=-1).indices
    for _ in range(20):
        picked = choose(logits, sampling(5.0, top_k=3))
        assert (picked[:, None] == top3).any(-1).all()
    peaked = torch.tensor([[10.0, 9.0, 0.0, -5.0]])  # p = 0.73, 0.27, 3e-5, ...: top-p 0.9 keeps two
    assert set(choose(peaked.expand(500, 4), sampling(top_p=0.9)).tolist()) == {0, 1}
    drawn = choose(peaked.expand(4000, 4), sampling())
    assert abs((drawn == 0).float().mean().item() - 0.731) < 0.03  # samples follow the softmax
    drawn = choose(peaked.expand(4000, 4), sampling(temperature=2.0))  # p(0) = 0.62 at temperature 2
    assert abs((drawn == 0).float().mean().item() - torch.softmax(peaked[0] / 2, 0)[0].item()) < 0.03


def test_sampling_is_seeded_and_reuses_the_step_across_temperatures():
    model, _ = tiny_model("llama")
    ids = tiny_input_ids(2, 5)
    torch.manual_seed(1)
    first = generate_graphed(model, ids, 8, do_sample=True, temperature=2.0, top_k=20, eos_token_id=[])
    loop = model._decode_loop.loop
    torch.manual_seed(1)
    assert torch.equal(generate_graphed(model, ids, 8, do_sample=True, temperature=2.0, top_k=20, eos_token_id=[]),
                       first)
    # temperature and top_p are the step's device scalars: near-zero temperature is greedy, on the same loop
    cold = generate_graphed(model, ids, 8, do_sample=True, temperature=1e-4, top_k=20, eos_token_id=[])
    assert model._decode_loop.loop is loop and loop.sampling.temperature.item() == pytest.approx(1e-4)
    assert torch.equal(cold, generate_graphed(model, ids, 8, eos_token_id=[]))
    generate_graphed(model, ids, 8, do_sample=True, top_k=5, eos_token_id=[])  # another top_k: another step
    assert model._decode_loop.loop.sampling.top_k == 5


def test_sampled_tokens_follow_the_distribution_of_transformers_sampling():
    """The loop's samples and transformers' generate's, over 3000 copies of one prompt with temperature,
    top_k and top_p on: the frequencies of the (first, second) new token pairs (the prefill's choice and one
    captured step's) agree within sampling noise (total variation; top_k 3 leaves at most 9 pairs)."""
    model, _ = tiny_model("llama")
    with torch.no_grad():  # peaked logits (a random model's are near uniform), so that the settings matter:
        model.lm_head.weight.mul_(20)  # temperature 1 instead of 1.5 gives a distance of 0.09, top_p 0.7 0.4
    ids = tiny_input_ids(1, 5).expand(3000, 5)
    options = dict(do_sample=True, temperature=1.5, top_k=3, top_p=0.95)
    torch.manual_seed(0)
    ours = generate_graphed(model, ids, 2, eos_token_id=[], **options)[:, -2:]
    theirs = model.generate(ids, max_new_tokens=2, min_new_tokens=2, pad_token_id=0, **options)[:, -2:]
    pairs = torch.cat([ours, theirs]).unique(dim=0)
    assert len(pairs) >= 4  # many pairs drawn: the check is not between two near-greedy runs

    def frequency(tokens):
        return ((tokens[:, None] == pairs).all(-1).float().sum(0) / len(tokens))

    assert 0.5 * (frequency(ours) - frequency(theirs)).abs().sum() < 0.06


def test_bad_arguments():
    model, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="input_ids must be"):
        generate_graphed(model, torch.zeros(2, 0, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens positive"):
        generate_graphed(model, tiny_input_ids(1, 4), 0)
    with pytest.raises(ValueError, match="temperature > 0"):
        generate_graphed(model, tiny_input_ids(1, 4), 4, do_sample=True, temperature=0.0)


def test_sliding_window_cache_is_refused():
    model, _ = tiny_model("mistral", sliding_window=4)
    with pytest.raises(ValueError, match="counts positions on the host"):
        generate_graphed(model, tiny_input_ids(1, 4), 4)


def converted(family, folder):
    """(a relufied tiny model of `family`, its checkpoint exported to `folder` and loaded through the modeling file,
    that file's module)."""
    model, tokenizer = tiny_model(family)
    relufy(model)
    out = export_checkpoint(model, tokenizer, folder, spec=spec_for(model.config), plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    return model, remote, sys.modules[type(remote).__module__]


def recorded(monkeypatch, module, name, what=lambda first: first.shape) -> list:
    """The list to which each later call of module.name adds what(its first argument), the call unchanged."""
    calls, function = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda first, *a, **k: calls.append(what(first)) or function(first, *a, **k))
    return calls


@pytest.mark.interpreter
def test_converted_checkpoint_decodes_on_the_kernels(tmp_path, monkeypatch):
    """Its MLPs on the kernels, one position a sequence at each decode step; the keys and values on cache_write.py's
    kernel from the first decode step on (the prefill's update allocates the static cache: transformers')."""
    model, remote, modeling = converted("llama", tmp_path / "ckpt")
    calls = recorded(monkeypatch, modeling, "gated_mlp", lambda x: x.shape[:-1])
    decoder = sys.modules[f"{modeling.__name__.rsplit('.', 1)[0]}.decoder"]
    written = recorded(monkeypatch, decoder, "cache_write_fitted")
    ids = tiny_input_ids(2, 5)
    generated = remote.generate_graphed(ids, 6, eos_token_id=[])
    assert calls and all(shape == (2, 1) for shape in calls[1:])  # the prefill, then one position a sequence
    assert len(written) == 5 * model.config.num_hidden_layers  # five decode steps after the prefill
    assert torch.equal(generated, reference(model, ids, 6, eos_token_id=None, pad_token_id=0))


@pytest.mark.interpreter
def test_converted_checkpoint_attends_on_the_kernel_at_decode(tmp_path, monkeypatch):
    """The checkpoint's attention is sdpa with its decode calls on decode_attention.py's kernel: the prefill's calls
    take sdpa, the decode steps' the kernel (traced too), the tokens those of transformers' generate;
    fuse_attention(False) gives sdpa back, and the saved config names neither. (The prompt is longer than the
    kernel's MAX_QUERIES tokens.)"""
    model, remote, modeling = converted("llama", tmp_path / "ckpt")
    # the MLPs dense, as where Triton is missing: the attention is what this checks (the test above runs the MLPs'
    # kernels at decode), and the interpreter's MLP kernels would make every step slow
    monkeypatch.setattr(modeling, "use_triton", lambda x: False)
    assert remote.config._attn_implementation == modeling.ATTENTION
    calls = recorded(monkeypatch, modeling, "decode_attention_fitted")
    ids = tiny_input_ids(2, 20)
    generated = remote.generate_graphed(ids, 6, eos_token_id=[])
    assert torch.equal(generated, reference(model, ids, 6, eos_token_id=None, pad_token_id=0))
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    assert calls and set(calls) == {(2, heads, 1, dim)}  # decode steps only: a prefill is SDPA's
    calls.clear()
    remote.fuse_attention(False)
    assert remote.config._attn_implementation == "sdpa"
    assert torch.equal(remote.generate_graphed(ids, 6, eos_token_id=[]), generated) and not calls
    remote.fuse_attention()
    remote.save_pretrained(tmp_path / "saved")
    assert "twell_sdpa" not in (tmp_path / "saved" / "config.json").read_text()
    # traced, the decode steps reach the kernel through its custom op
    launched = recorded(monkeypatch, sys.modules[f"{modeling.__name__.rsplit('.', 1)[0]}.decode_attention"], "_launch")
    compiled = remote.generate_graphed(ids, 6, eos_token_id=[], compile=dict(backend="eager", fullgraph=True))
    assert torch.equal(compiled, generated) and set(launched) == {(2, heads, 1, dim)}
    # an uncaptured GPU call launches the kernel the first time its signature comes (it loads the kernel before a
    # capture), the last SETTLED_SIGNATURES signatures kept; calls without one (CPU, captured) always launch
    monkeypatch.setattr(modeling, "SETTLED_SIGNATURES", 2)
    monkeypatch.setattr(modeling, "_SETTLED_ATTENTION", type(modeling._SETTLED_ATTENTION)())
    assert [modeling.takes_kernel(s) for s in ("a", "a", "b", "c", "a", "c", None, None)] == [
        True, False, True, True, True, False, True, True]


@pytest.mark.interpreter
def test_grouped_heads_take_the_kernel_at_any_batch_where_sdpa_copies_them(tmp_path, monkeypatch):
    """A masked call of grouped query heads beyond the sequences x key/value heads rule takes the kernel where the
    running transformers' sdpa copies each key/value head for its query heads (SDPA_REPEATS_KV), sdpa where it packs
    them; a call without grouped heads follows the rule either way. Both give sdpa's output."""
    _, _, modeling = converted("llama", tmp_path / "ckpt")
    calls = recorded(monkeypatch, modeling, "decode_attention_fitted")
    monkeypatch.setattr(modeling, "device_sms", lambda device: 2)  # 3 sequences x 2 key/value heads: beyond it
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 1, 1, 24, dtype=torch.bool)
    mask[1, ..., 20:] = False
    for heads, kv_heads in ((4, 2), (2, 2)):
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = heads // kv_heads, True
        query = torch.randn(3, heads, 1, 16, generator=generator)
        key, value = (torch.randn(3, kv_heads, 24, 16, generator=generator) for _ in range(2))
        expected = modeling.sdpa_attention_forward(module, query, key, value, mask)[0]
        for repeats, served in ((True, heads > kv_heads), (False, False)):
            monkeypatch.setattr(modeling, "SDPA_REPEATS_KV", repeats)
            calls.clear()
            out = modeling.attention_forward(module, query, key, value, mask)[0]
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            assert bool(calls) is served


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_sliding_window_checkpoints_attend_on_the_kernel_in_transformers_generate(family, tmp_path, monkeypatch):
    """transformers' own generate (a dynamic cache, sliding-window layers' masks) over a converted checkpoint: its
    decode steps' attention on the kernel, the tokens those of the source model's generate."""
    model, remote, modeling = converted(family, tmp_path / "ckpt")
    monkeypatch.setattr(modeling, "use_triton", lambda x: False)  # the MLPs dense, as in the test above
    calls = recorded(monkeypatch, modeling, "decode_attention_fitted")
    ids = tiny_input_ids(2, 20)
    options = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(remote.generate(ids, graphed=False, **options), model.generate(ids, **options))
    assert len(calls) == 4 * model.config.num_hidden_layers  # every decode step's layers


def test_compiled_loops_count_their_own_recompiles():
    """More loops of one model compiled with fullgraph in one process than dynamo's recompile limit allows a code
    object (a batch size each): each compiles under its own, so none fails on the count of those before it."""
    model, _ = tiny_model("llama")
    compile = dict(backend="eager", fullgraph=True, dynamic=False)
    for batch in range(1, torch._dynamo.config.recompile_limit + 2):
        ids = tiny_input_ids(batch, 5)
        assert torch.equal(generate_graphed(model, ids, 3, eos_token_id=[], compile=compile),
                           reference(model, ids, 3, eos_token_id=None, pad_token_id=0))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_graph_replay_matches_generate_on_gpu(tmp_path, compile):
    """fp32 so that greedy ties cannot flip between the captured and the uncaptured step."""
    model, tokenizer = tiny_model("llama")
    relufy(model)
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt", spec=spec_for(model.config), plan=PLAN,
                            training=TRAINING)
    ids = tiny_input_ids(3, 9).cuda()
    for loaded in (model.cuda(), AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).cuda().eval()):
        expected = reference(loaded, ids, 40, eos_token_id=None, pad_token_id=0)
        assert torch.equal(generate_graphed(loaded, ids, 40, eos_token_id=[], compile=compile), expected)
        if compile and hasattr(loaded, "release_graphed"):  # generate with a static cache: the compiled loop,
            # compiled as a compile_config says (transformers' default mode records CUDA graphs: left to the loop)
            for config in (None, CompileConfig(fullgraph=True, dynamic=False)):
                static = loaded.generate(ids, max_new_tokens=40, eos_token_id=None, pad_token_id=0,
                                         cache_implementation="static", compile_config=config)
                loop = loaded._decode_loop.loop
                assert torch.equal(static, expected) and loop.forward is not loop.model and loop.graph is not None
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # a left-padded prompt: the same captured step, another mask
        padded = ids.masked_fill(mask == 0, 0)
        assert torch.equal(generate_graphed(loaded, padded, 40, attention_mask=mask, eos_token_id=[], compile=compile),
                           reference(loaded, padded, 40, attention_mask=mask, eos_token_id=None, pad_token_id=0))
        sampled = []
        for _ in range(2):  # the captured sampling step draws from the seeded generator at each replay
            torch.manual_seed(3)
            sampled.append(generate_graphed(loaded, ids, 40, do_sample=True, top_k=8, eos_token_id=[], compile=compile))
        assert torch.equal(*sampled) and not torch.equal(sampled[0], expected)
        assert (sampled[0] < loaded.config.vocab_size).all() and len(set(sampled[0][0, 9:].tolist())) > 1
        sampled_loop = loaded._decode_loop.loop
        assert sampled_loop.graph is not None
        longer = tiny_input_ids(3, 30).cuda()  # a longer prompt and another temperature: the same captured step
        generate_graphed(loaded, longer, 20, do_sample=True, temperature=0.5, top_k=8, eos_token_id=[], compile=compile)
        assert loaded._decode_loop.loop is sampled_loop
        assert torch.equal(generate_graphed(loaded, longer, 20, eos_token_id=[], compile=compile),
                           reference(loaded, longer, 20, eos_token_id=None, pad_token_id=0))
        greedy_loop = loaded._decode_loop.loop
        assert torch.equal(generate_graphed(loaded, ids, 40, eos_token_id=[], compile=compile), expected)
        assert loaded._decode_loop.loop is greedy_loop
        # prompts of 30 and 9 tokens ran padded to 32 and 16 through captured prefills; 7 tokens reuse 16's
        assert sorted(greedy_loop.prefill_graphs) == [16, 32]
        assert torch.equal(generate_graphed(loaded, ids[:, :7], 20, eos_token_id=[], compile=compile),
                           reference(loaded, ids[:, :7], 20, eos_token_id=None, pad_token_id=0))
        assert sorted(greedy_loop.prefill_graphs) == [16, 32]
        loaded.cpu().cuda()  # the captured graphs would read the weights' old addresses: a new loop captures
        assert torch.equal(generate_graphed(loaded, ids, 40, eos_token_id=[], compile=compile), expected)
        assert loaded._decode_loop.loop is not greedy_loop


def test_calls_from_two_threads_are_serialized_and_release_frees_the_loop():
    from concurrent.futures import ThreadPoolExecutor

    from sparsify.remote.generation import release_graphed

    model, _ = tiny_model("llama")
    prompts = [tiny_input_ids(2, 5 + i) for i in range(6)]
    serial = [generate_graphed(model, ids, 24, eos_token_id=[]) for ids in prompts]
    with ThreadPoolExecutor(2) as pool:  # one loop on the model, shared by both threads
        threaded = list(pool.map(lambda ids: generate_graphed(model, ids, 24, eos_token_id=[]), prompts))
    assert all(torch.equal(a, b) for a, b in zip(threaded, serial))
    assert model._decode_loop.loop is not None
    release_graphed(model)
    assert model._decode_loop.loop is None
    assert torch.equal(generate_graphed(model, prompts[0], 24, eos_token_id=[]), serial[0])  # built anew


def test_the_loop_goes_with_the_model():
    """The loop holds its model weakly: deleting the model frees its cache without the garbage collector."""
    import gc
    import weakref

    model, _ = tiny_model("llama")
    generate_graphed(model, tiny_input_ids(1, 5), 4, eos_token_id=[])
    model_ref, loop_ref = weakref.ref(model), weakref.ref(model._decode_loop.loop)
    gc.disable()
    try:
        del model
        assert loop_ref() is None and model_ref() is None
    finally:
        gc.enable()


def converted_checkpoint(tmp_path, monkeypatch):
    """A converted checkpoint planned dense, its norms and rotary on transformers' modules too (its modeling file
    answering as where Triton is missing): the routing of generate, not the kernels (the test above and
    test_export.py's), is what these tests check, and the kernels under the interpreter make every step slow."""
    model, tokenizer = tiny_model("llama")
    relufy(model)
    dense = [LayerPlan()] * model.config.num_hidden_layers
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt", spec=spec_for(model.config), plan=dense,
                            training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    monkeypatch.setattr(sys.modules[type(remote).__module__], "use_triton", lambda x: False)  # the MLPs
    decoder_unfused(monkeypatch, type(remote).__module__)
    return remote, tokenizer, out


def test_generate_takes_the_loop_where_the_call_fits_and_falls_back_elsewhere(tmp_path, monkeypatch):
    """model.generate on a converted checkpoint: greedy and max_length calls run the graphed loop with
    transformers' tokens (a static cache with the loop's compiled step); beam search, a logits processor,
    returned dicts, right padding, other caches and graphed=False go to
    transformers' generate unchanged. Moving or casting the model frees the loop, before the weights move."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    remote, _, _ = converted_checkpoint(tmp_path, monkeypatch)
    ids = tiny_input_ids(2, 6)
    plain = lambda **kw: remote.generate(ids, graphed=False,  # noqa: E731
                                         **{"eos_token_id": None, "pad_token_id": 0, **kw})
    fast = remote.generate(ids, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert remote._decode_loop.loop is not None  # the loop ran it
    assert torch.equal(fast, plain(max_new_tokens=12))
    assert torch.equal(remote.generate(ids, max_length=15, eos_token_id=None, pad_token_id=0), plain(max_length=15))
    eos = int(fast[1, 6 + 1])  # the second sequence's second new token
    for least in (dict(min_new_tokens=6), dict(min_length=10)):  # min_length counts the prompt
        remote.release_graphed()
        out = remote.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, **least)
        assert remote._decode_loop.loop is not None, least
        assert torch.equal(out, plain(max_new_tokens=12, eos_token_id=eos, **least)), least
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a shorter first prompt, padded on the left
    assert torch.equal(remote.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, pad_token_id=0),
                       plain(attention_mask=mask, max_new_tokens=8))
    others = [dict(num_beams=2), dict(repetition_penalty=1.3), dict(return_dict_in_generate=True),
              dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))]
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    for options in others + [dict(attention_mask=right)]:
        remote.release_graphed()
        out = remote.generate(ids, max_new_tokens=5, eos_token_id=None, pad_token_id=0, **options)
        assert remote._decode_loop.loop is None, options  # transformers' generate ran it
        expected = plain(max_new_tokens=5, **options)
        if options.get("return_dict_in_generate"):
            out, expected = out.sequences, expected.sequences
        assert torch.equal(out, expected), options
    # a static cache is where transformers compiles the step: the loop's compiled step serves it
    static = graphed_call(remote, ids, dict(max_new_tokens=5, cache_implementation="static"))
    assert static["compile"] and not graphed_call(remote, ids, dict(max_new_tokens=5))["compile"]
    # compiled as the call's compile_config says (which configures nothing without a static cache, or with
    # disable_compile), its CUDA graphs left to the loop's capture
    configured = CompileConfig(fullgraph=False, mode="max-autotune", dynamic=True)
    compile = graphed_call(remote, ids, dict(max_new_tokens=5, cache_implementation="static",
                                             compile_config=configured))["compile"]
    assert compile_options(compile) == dict(fullgraph=False, dynamic=True, backend="inductor",
                                            mode="max-autotune-no-cudagraphs", options=None)
    # what compile=True does, configured: the same compile (one loop serves both calls)
    assert compile_options(CompileConfig(fullgraph=True, dynamic=False).to_dict()) == compile_options(True)

    class Backend:  # a backend object: generate deep-copies it at every call, the loop's key stays
        def __call__(self, graph, inputs):
            return graph

    backend = CompileConfig(backend=Backend()).to_dict()
    assert _compile_key(backend) == _compile_key(copy.deepcopy(backend)) != _compile_key(True)
    assert compile_options(dict(compile, mode="reduce-overhead", options={"triton.cudagraphs": True,
                                                                          "max_autotune": True})) == dict(
        compile, mode=None, options={"max_autotune": True})
    assert compile_options(CompileConfig(backend="cudagraphs").to_dict()) is None
    assert not graphed_call(remote, ids, dict(max_new_tokens=5, compile_config=configured))["compile"]
    assert not graphed_call(remote, ids, dict(max_new_tokens=5, cache_implementation="static", disable_compile=True,
                                              compile_config=configured))["compile"]
    remote.release_graphed()
    out = remote.generate(ids, max_new_tokens=12, eos_token_id=None, pad_token_id=0, cache_implementation="static",
                          disable_compile=True)
    assert remote._decode_loop.loop is not None and torch.equal(out, fast)
    assert graphed_call(remote, ids, dict(max_new_tokens=5, cache_implementation="offloaded")) is None
    remote.release_graphed()  # sampling takes the loop too; top_k 1 leaves one token to draw: the greedy one
    sampled = remote.generate(ids, do_sample=True, top_k=1, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert remote._decode_loop.loop is not None and torch.equal(sampled, fast)
    remote.to("cpu")  # nothing moves: the loop stays
    assert remote._decode_loop.loop is not None
    # a move or cast frees the loop (its cache and graphs hold the old tensors), before the weights move
    modeling = sys.modules[type(remote).__module__]
    release, freed_at = modeling.release_graphed, []

    def recorded(model):
        freed_at.append(next(model.parameters()).dtype)
        release(model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling, "release_graphed", recorded)
        remote.to(torch.float64)
    assert freed_at[0] == torch.float32 and remote._decode_loop.loop is None and remote.dtype == torch.float64
    remote.to(torch.float32)
    remote.generation_config.graphed = False  # the switch in the generation config
    remote.generate(ids, max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    assert remote._decode_loop.loop is None


def test_unset_settings_take_transformers_defaults_and_the_model_pickles(tmp_path, monkeypatch):
    """A generate call that sets no length or top_k runs as transformers' generate would (its global defaults:
    20 new tokens, top_k 50), through the loop; the loaded class is the module's own, so models pickle."""
    import pickle

    remote, _, out = converted_checkpoint(tmp_path, monkeypatch)
    ids = tiny_input_ids(2, 6)
    call = graphed_call(remote, ids, dict(do_sample=True))
    assert call["max_new_tokens"] == 20 and call["top_k"] == 50 and call["temperature"] == 1.0
    assert graphed_call(remote, ids, dict(do_sample=True, top_k=0))["top_k"] == 0  # set: kept
    fast = remote.generate(ids, eos_token_id=None, pad_token_id=0)
    assert remote._decode_loop.loop is not None
    with pytest.warns(UserWarning, match="default `max_length`"):  # transformers' own default, as the loop's
        assert torch.equal(fast, remote.generate(ids, eos_token_id=None, pad_token_id=0, graphed=False))
    assert fast.shape == (2, 6 + 20)
    again = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(again) is type(remote) is getattr(sys.modules[type(remote).__module__], "TwellForCausalLM")
    copied = pickle.loads(pickle.dumps(remote))
    assert torch.equal(copied(ids).logits, remote(ids).logits)


def test_generate_streams_and_serves_the_text_generation_pipeline(tmp_path, monkeypatch):
    from transformers import TextStreamer, pipeline

    remote, tokenizer, path = converted_checkpoint(tmp_path, monkeypatch)
    ids = tiny_input_ids(1, 6)

    class Collect(TextStreamer):
        text = ""

        def on_finalized_text(self, text, stream_end=False):
            Collect.text += text

    out = remote.generate(ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0,
                          streamer=Collect(tokenizer, skip_prompt=True))
    assert remote._decode_loop.loop is not None
    assert Collect.text == tokenizer.decode(out[0, 6:])
    remote.release_graphed()
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    pipelines = transformers_logging.get_logger("transformers.pipelines.base")
    pipelines.addHandler(handler)
    try:
        generator = pipeline("text-generation", model=path, tokenizer=tokenizer, trust_remote_code=True)
    finally:
        pipelines.removeHandler(handler)
    assert not [message for message in logged if "not supported" in message]  # the class is a known causal LM
    text = generator("def f(x):", max_new_tokens=10, do_sample=False)[0]["generated_text"]
    assert text.startswith("def f(x):") and generator.model._decode_loop.loop is not None
    assert AutoModelForCausalLM.from_config(tiny_model("llama")[0].config).__class__.__name__ == "LlamaForCausalLM"
