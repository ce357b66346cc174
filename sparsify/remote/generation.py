"""Decoding with the host out of the loop: each new token is one CUDA-graph replay of a decode step.

transformers' `generate` runs Python at every step (input preparation, logits processors, stopping criteria,
cache bookkeeping; with a compiled static cache also the guards and the CUDA-graph tree's checks): milliseconds
a token, more than the GPU work of a 1.5B model, so a faster model decodes no faster there. Here one step
(forward over a static KV cache, token choice, end-of-sequence bookkeeping, the token written into the output
and the attention mask) is captured once as a CUDA graph and replayed: the host launches a graph a token and
reads `finished` every CHECK_EVERY tokens. The prompt's prefill is a CUDA graph too (an eager prefill of a
short prompt is host-bound: launching a 28-layer forward takes longer than running it): the prompt is
left-padded to one of a few lengths (padded_length), each captured once. The graphs and the static cache
stay on the model and serve every later call of the same batch size and structural options (greedy or
sampling, top_k, top-p on or off) that fits the cache: a new cache's length is rounded up to CACHE_ROUND, so
prompts of other lengths reuse the captured (and compiled) step, and temperature and top_p are device
scalars set at each call. One loop is kept at a time (a cache is batch x length x layers of keys and
values); it is rebuilt when the model's weights move (another device or dtype): a graph reads the
addresses it was captured with. Calls from several threads on one model take turns (a lock), and
`release_graphed` frees the loop.
Works for any causal LM of transformers whose static cache keeps its positions on the device (Llama, Mistral
without a sliding window, Qwen2/3 and the like), dense or converted; off CUDA the same prefill and step run
directly.
Shipped beside modeling_twell.py; imports torch and transformers only.
"""
import copy
import inspect
import threading
import weakref

import torch

CHECK_EVERY = 16  # tokens between the host's reads of `finished` (each read waits for the GPU)
CACHE_ROUND = 256  # a new cache's length: prompt + new tokens rounded up to a multiple of this (at most the
# model's max_position_embeddings, unless the call needs more)
PREFILL_GRAPH_TOKENS = 4096  # the largest prefill (batch x padded prompt) captured as a graph: above it the GPU
# work outlasts the launches, and a graph would keep that much activation memory


def padded_length(n: int) -> int:
    """The length a prompt of n tokens is left-padded to for its prefill: a power of two from 16 up to 256,
    then a multiple of 256, so that few prefill graphs serve all prompt lengths at under 2x the tokens."""
    return max(16, 1 << (n - 1).bit_length()) if n <= 256 else -(-n // 256) * 256


def cache_arguments(model, cache, position: torch.Tensor) -> dict:
    """The static KV cache and the positions a forward writes, as this transformers version's forward takes
    them: `cache` (the cache tracks its own length) where the forward has it, else `past_key_values` and
    `cache_position`."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": cache}
    return {"past_key_values": cache, "cache_position": position}


class Sampling:
    """Sampling settings of a step: `top_k` (0: off) and whether top-p filters at all (`nucleus`) shape the
    captured step; temperature and top_p are device scalars, written before each call (`set`), so one capture
    serves any values."""

    def __init__(self, top_k: int, nucleus: bool, device):
        self.top_k, self.nucleus = top_k, nucleus
        self.temperature = torch.ones((), device=device)
        self.top_p = torch.ones((), device=device)

    def set(self, temperature: float, top_p: float):
        self.temperature.fill_(temperature)
        self.top_p.fill_(top_p)


def choose(logits: torch.Tensor, sampling: Sampling | None) -> torch.Tensor:
    """Next token [batch] from logits [batch, vocab]: the argmax (sampling None), or a sample after
    temperature, top-k and top-p (nucleus) filtering. Device-side only (no host synchronization), so it can
    be captured."""
    if sampling is None:
        return logits.argmax(-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.nucleus:
        ordered, order = scores.sort(dim=-1, descending=True)
        # drop a token once the tokens ranked above it already hold top_p of the mass (the first always stays)
        probs = ordered.softmax(-1)
        above = probs.cumsum(-1) - probs
        scores = scores.scatter(-1, order, ordered.masked_fill(above >= sampling.top_p, float("-inf")))
    # a sample from the softmax without torch.multinomial's host synchronization: argmax of p / Exp(1) noise
    return (scores.softmax(-1) / torch.empty_like(scores).exponential_()).argmax(-1)


class DecodeLoop:
    """A static KV cache for `batch` sequences of up to `max_len` tokens, the output buffer, one decode step
    over them (`step`) and prefills of the padded prompt lengths (`prefill`), captured as CUDA graphs on CUDA;
    the attention mask over the cache slots follows the tokens written. `sampling` is choose()'s (None:
    greedy), `stop` the end-of-sequence ids (may be empty), `pad` what follows them."""

    def __init__(self, model, batch: int, max_len: int, device, sampling: Sampling | None, stop: tuple, pad: int,
                 compile: bool | dict):
        from transformers import StaticCache

        # the model holds this loop (HeldLoop): a weak reference back lets `del model` free both at once (a
        # compiled forward holds the model, so that loop goes when the garbage collector finds the cycle)
        self.model, self.sampling, self.pad, self.max_len = weakref.proxy(model), sampling, pad, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        options = compile_options(compile)
        self.forward = torch.compile(own_code(model), **options) if options is not None else self.model
        self.stop = torch.tensor(stop, dtype=torch.long, device=device)
        self.sequences = torch.full((batch, max_len), pad, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        # the position of the newest token in self.sequences: the token the next step feeds to the model
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        # the first position from which a stop id may be chosen: the prompt's last slot + min_new_tokens
        self.stop_from = torch.zeros(1, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        # which cache slots hold tokens (0: a prompt's left padding, or not written yet), and each sequence's
        # padding length (its positions count from its first real token)
        self.mask = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.pads = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # the step writes at self.position (updated in place), so its cache arguments are made once
        self.step_cache = cache_arguments(model, self.cache, self.position)
        host_counted = [type(layer).__name__ for layer in self.cache.layers if hasattr(layer, "cumulative_length_int")]
        if host_counted:
            raise LoopUnsupported(f"{host_counted[0]}: this cache counts positions on the host (sliding-window "
                             "attention), which a captured step cannot advance; use model.generate")
        self.graph, self.prefill_graphs = None, {}  # prefill_graphs: padded prompt length -> graph
        if device.type == "cuda":
            self.prefill_pool = torch.cuda.graph_pool_handle()  # one at a time runs: they share their memory
            self.mask[:, 0] = 1  # the warm-up steps start from slot 0
            self.graph = self._capture(self.step)

    def _capture(self, fn, pool=None) -> torch.cuda.CUDAGraph:
        """fn captured as a CUDA graph, after warm-up calls on a side stream (they compile and plan the
        kernels and allocate the cache); the caller resets what they wrote. The random generator is left as
        the warm-up found it, so that a seeded call samples alike whether or not it captured."""
        device = self.sequences.device
        with torch.random.fork_rng(devices=[device]):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn()
        return graph

    def advance(self, logits: torch.Tensor):
        """Takes the next token from `logits` [batch, vocab] for the position after self.position: pad for
        finished sequences; records it, marks sequences that reached a stop id, moves the position on. Stop ids
        cannot be chosen before min_new_tokens (as transformers' min-length logits processors do)."""
        if self.stop.numel():
            early = self.position < self.stop_from
            logits.index_copy_(-1, self.stop, logits.index_select(-1, self.stop).masked_fill(early, float("-inf")))
        nxt = torch.where(self.finished, self.pad, choose(logits, self.sampling))
        self.finished |= torch.isin(nxt, self.stop)
        self.position += 1
        self.sequences.index_copy_(1, self.position, nxt[:, None])
        self.mask.index_fill_(1, self.position, 1)

    def step(self):
        """One decode step: the token at self.position through the model, the next one chosen (advance)."""
        tokens = self.sequences.index_select(1, self.position)
        logits = self.forward(input_ids=tokens, attention_mask=self.mask, position_ids=self.position - self.pads,
                              **self.step_cache, use_cache=True).logits
        self.advance(logits[:, -1])

    def prefill(self, length: int):
        """The first `length` slots (a prompt, left-padded) through the model (eager: a compiled forward
        would recompile for every length), the first new token chosen."""
        slots = self.slots[:length]
        logits = self.model(input_ids=self.sequences[:, :length], attention_mask=self.mask,
                            position_ids=(slots - self.pads).clamp(min=0),
                            **cache_arguments(self.model, self.cache, slots), use_cache=True, logits_to_keep=1).logits
        self.advance(logits[:, -1])

    def load(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int, min_new_tokens: int):
        """The state before a prefill: the prompt at slots length - n .. length - 1, padding before it."""
        n = input_ids.shape[1]
        self.cache.reset()
        self.sequences.fill_(self.pad)
        self.sequences[:, length - n:length] = input_ids
        self.mask.zero_()
        self.mask[:, length - n:length] = attention_mask
        self.pads.copy_(length - attention_mask.sum(-1, keepdim=True))
        self.finished.zero_()
        self.position.fill_(length - 1)
        self.stop_from.fill_(length - 1 + min_new_tokens)

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
            min_new_tokens: int = 0, streamer=None) -> torch.Tensor:
        """The prompt's prefill, then up to max_new_tokens - 1 steps, checking every CHECK_EVERY tokens
        whether every sequence finished (none can before min_new_tokens). Returns [batch, prompt + generated]
        token ids, ending where the last sequence ended, as generate's. `streamer` (transformers' streamer
        interface: put, end) gets the prompt, then the new tokens every CHECK_EVERY tokens."""
        batch, n = input_ids.shape
        length = padded_length(n)
        # padded where a graph may serve it (on CUDA one is captured, elsewhere the same prefill runs directly)
        padded = length + max_new_tokens <= self.max_len and batch * length <= PREFILL_GRAPH_TOKENS
        length = length if padded else n
        self.load(input_ids, attention_mask, length, min_new_tokens)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        if padded and self.graph is not None:
            if length not in self.prefill_graphs:
                self.prefill_graphs[length] = self._capture(lambda: self.prefill(length), self.prefill_pool)
                self.load(input_ids, attention_mask, length, min_new_tokens)
            self.prefill_graphs[length].replay()
        else:
            self.prefill(length)
        done, sent = 1, 0  # tokens generated, and handed to the streamer
        while True:
            if done % CHECK_EVERY == 0 or done == max_new_tokens:  # the host waits for the GPU here
                ended = bool(self.stop.numel()) and bool(self.finished.all())
                if ended or done == max_new_tokens:
                    break
                if streamer is not None:
                    streamer.put(self.sequences[:, length + sent:length + done].cpu())
                    sent = done
            self.graph.replay() if self.graph is not None else self.step()
            done += 1
        if ended:  # up to the step where the last sequence reached a stop id
            stops = torch.isin(self.sequences[:, length:length + done], self.stop)
            done = int(stops.int().argmax(-1).max()) + 1
        if streamer is not None:
            streamer.put(self.sequences[:, length + sent:length + done].cpu())
            streamer.end()
        return self.sequences[:, length - n:length + done].clone()


# torch.compile modes that record CUDA graphs, and their twins without: the loop captures the whole step as one
# graph itself, inside which a compiled region cannot record graphs of its own
GRAPH_FREE_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}
# torch.compile's defaults of the arguments a CompileConfig sets
COMPILE_DEFAULTS = dict(fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None)


def own_code(model):
    """A call of `model` through a function with a code object of its own. torch.compile keeps its graphs and
    counts recompiles per code object, and a model's loops (one a batch size, sampling, compile setting) would
    share its forward's with transformers' own compiles of it: under fullgraph the compile after the limit (eight)
    fails. Each loop's graphs are then its own, and go with it."""
    def call(*args, **kwargs):
        return model(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # a new code object, equal to the shared one
    return call


def compile_options(compile: bool | dict) -> dict | None:
    """torch.compile's keyword arguments for the loop's step, all of COMPILE_DEFAULTS' (so that equal compiles
    compare equal): None (eager) for False, one graph of static shapes for True, else `compile` (a
    CompileConfig's to_dict()) with its CUDA graphs left to the loop (GRAPH_FREE_MODES, and no
    "triton.cudagraphs" option; the "cudagraphs" backend, which compiles nothing else, leaves the step eager)."""
    if compile is True:
        return dict(COMPILE_DEFAULTS, fullgraph=True, dynamic=False)
    if not compile or compile.get("backend") == "cudagraphs":
        return None
    options = dict(COMPILE_DEFAULTS, **compile)
    options["mode"] = GRAPH_FREE_MODES.get(options["mode"], options["mode"])
    if options["options"]:
        options["options"] = {k: v for k, v in options["options"].items() if k != "triton.cudagraphs"}
    return options


def _compile_key(compile) -> str | None:
    """compile_options as a loop's key: a backend object by its type (generate deep-copies the generation
    config, so the object is a new one at every call), a function by its name."""
    options = compile_options(compile)
    if options is None:
        return None
    backend = options["backend"]
    if not isinstance(backend, str):
        backend = getattr(backend, "__qualname__", None) or type(backend).__qualname__
    return repr(dict(options, backend=backend))


class LoopUnsupported(ValueError):
    """The model's cache cannot run in a captured step (raised before any token is generated)."""


# The generation settings the loop implements. A `generate` call that turns any other on (beam search,
# penalties, returned scores, ...; a setting that is false, 0 or None is off) or passes other arguments (logits
# processors, an assistant model, ...) goes to transformers' generate unchanged (graphed_call).
LOOP_SETTINGS = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
                 "top_p", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "graphed",
                 "transformers_version", "_from_model_config", "cache_implementation", "compile_config",
                 "disable_compile"}
LOOP_ARGUMENTS = {"input_ids", "attention_mask", "streamer", "generation_config", "graphed"}


def graphed_call(model, inputs, kwargs: dict) -> dict | None:
    """generate_graphed's arguments for `model.generate(inputs, **kwargs)` where the loop computes what
    transformers' generate would (greedy, or sampling with temperature / top_k / top_p, left-padded prompts,
    max_new_tokens or max_length, min_new_tokens or min_length, eos and pad, a streamer; a static cache, which
    transformers compiles, runs the loop's step compiled as the call's compile_config says), else None.
    `graphed=False` (an argument, or the generation config's attribute) turns it off; so does a model whose
    cache the loop cannot run."""
    if model.__dict__.get("_loop_unsupported"):
        return None
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    if config.update(**{k: v for k, v in kwargs.items() if k not in LOOP_ARGUMENTS}):
        return None  # arguments that are no generation setting: logits processors, assistants, embeddings, ...
    others = {k for k, v in config.to_diff_dict().items() if k not in LOOP_SETTINGS and v}
    if not kwargs.get("graphed", getattr(config, "graphed", True)) or others:
        return None
    if config.cache_implementation not in (None, "static"):  # offloaded, quantized, sliding-window caches
        return None
    compiles = config.cache_implementation == "static" and not config.disable_compile
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[1] > 0 and not ids.is_floating_point()):
        return None
    mask = kwargs.get("attention_mask")
    if mask is None:
        if config.pad_token_id is not None and (ids == config.pad_token_id).any():
            return None  # generate infers a mask from the pad tokens
    elif mask.shape != ids.shape or not mask[:, -1].all() or (mask[:, 1:] < mask[:, :-1]).any():
        return None  # not padded on the left
    # settings left unset (None) take transformers' global defaults, as its generate does (top_k 50, ...)
    defaults = getattr(config, "_get_default_generation_params", dict)()

    def setting(name, fallback):
        value = getattr(config, name)
        return defaults.get(name, fallback) if value is None else value

    if config.max_new_tokens is not None:
        new = config.max_new_tokens
    elif config.max_length is not None:
        new = config.max_length - ids.shape[1]
    else:  # no length set: the default max_length's count of new tokens, within the model's positions
        limit = getattr(model.config, "max_position_embeddings", None) or float("inf")
        new = min(defaults.get("max_length", 20), limit - ids.shape[1])
    if new < 1:
        return None
    least = max(config.min_new_tokens or 0, setting("min_length", 0) - ids.shape[1])
    return dict(input_ids=ids, max_new_tokens=new, min_new_tokens=least, attention_mask=mask,
                do_sample=bool(setting("do_sample", False)), temperature=setting("temperature", 1.0),
                top_k=setting("top_k", 0) or 0, top_p=setting("top_p", 1.0),
                eos_token_id=[] if config.eos_token_id is None else config.eos_token_id,
                pad_token_id=config.pad_token_id, streamer=kwargs.get("streamer"),
                # a static cache is where transformers compiles the decode step: the loop's step, compiled as
                # the call's compile_config says
                compile=compiles and (config.compile_config.to_dict() if config.compile_config else True))


def release_graphed(model) -> None:
    """Frees the decode loop that generate_graphed keeps on `model` (its static cache and graphs); the next
    call builds a new one."""
    held = model.__dict__.get("_decode_loop")
    if held is not None:
        with held.lock:
            held.key = held.loop = None


@torch.inference_mode()
def generate_graphed(model, input_ids: torch.Tensor, max_new_tokens: int, *, min_new_tokens: int = 0,
                     attention_mask=None, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, eos_token_id=None, pad_token_id=None, compile: bool | dict = False,
                     streamer=None) -> torch.Tensor:
    """`model`'s continuation of `input_ids` [batch, prompt] (prompts of different lengths padded on the
    left, with `attention_mask` 0 there), like `model.generate(input_ids, attention_mask=...,
    max_new_tokens=..., do_sample=...)` for greedy decoding and for sampling with temperature, top_k and
    top_p: [batch, prompt + new] ids, with pad_token_id after a sequence's end-of-sequence token, ending
    where the last sequence ended (the decoding itself runs on by up to CHECK_EVERY - 1 steps), and never
    before min_new_tokens (an end-of-sequence token is not chosen before). eos_token_id (an id or a list; []
    for none) and pad_token_id default to the model's generation config. `streamer`
    (e.g. transformers' TextStreamer) gets the new tokens every CHECK_EVERY tokens. `compile`: the step's forward
    through torch.compile before capture, fastest (True: one graph, static shapes; a dict: torch.compile's
    arguments, as a CompileConfig's to_dict(), see compile_options; the first call of a batch size compiles,
    which takes far longer than capturing). The first call of a batch size and of greedy or sampling
    (with its top_k, and top_p < 1 or not) captures the step, and the first prompt of
    each padded length (padded_length) its prefill; later calls that fit the cache reuse them, whatever
    their prompt length, temperature and top_p."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0 or max_new_tokens < 1 or min_new_tokens < 0:
        raise ValueError(f"input_ids must be [batch, prompt] with a prompt, max_new_tokens positive and "
                         f"min_new_tokens >= 0; got {tuple(input_ids.shape)}, {max_new_tokens} and {min_new_tokens}")
    if do_sample and not (temperature > 0 and top_k >= 0 and 0 < top_p <= 1):
        raise ValueError(f"sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1; got {temperature}, "
                         f"{top_k}, {top_p}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape or not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError(f"attention_mask must be 0 / 1 of the shape of input_ids {tuple(input_ids.shape)}")
    elif (attention_mask[:, 1:] < attention_mask[:, :-1]).any() or not attention_mask[:, -1].all():
        raise ValueError("attention_mask: pad prompts on the left (tokenizer padding_side='left')")
    config = getattr(model, "generation_config", None)
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    stop = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (stop[0] if stop else 0)
    batch, n = input_ids.shape
    needed = n + max_new_tokens
    wanted = padded_length(n) + max_new_tokens  # room for the padded prefill too
    weights = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    key = (batch, str(input_ids.device), do_sample and (top_k, top_p < 1), stop, pad, _compile_key(compile), weights)
    held = model.__dict__.setdefault("_decode_loop", HeldLoop())
    with held.lock:  # one loop (cache, graphs) a model: calls from several threads take turns
        if held.key != key or held.loop.max_len < needed:
            held.key = held.loop = None  # the previous cache goes before the new one is allocated
            limit = getattr(model.config, "max_position_embeddings", None) or needed
            length = max(needed, min(-(-wanted // CACHE_ROUND) * CACHE_ROUND, limit))
            sampling = Sampling(top_k, top_p < 1, input_ids.device) if do_sample else None
            held.loop = DecodeLoop(model, batch, length, input_ids.device, sampling, stop, pad, compile)
            held.key = key
        if held.loop.sampling is not None:
            held.loop.sampling.set(temperature, top_p)
        return held.loop.run(input_ids, attention_mask.to(input_ids.device, torch.long), max_new_tokens,
                             min_new_tokens, streamer)


class HeldLoop:
    """The DecodeLoop kept on a model for its next call, and the lock its calls take. Copies and pickles of the
    model start without one (a CUDA graph cannot be copied, and the copy has weights of its own)."""

    def __init__(self):
        self.key = self.loop = None
        self.lock = threading.Lock()

    def __deepcopy__(self, memo):
        return HeldLoop()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()
