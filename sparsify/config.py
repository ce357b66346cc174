"""A conversion's settings, as typed dataclasses whose fields the CLI's options are made from (one field per
option, its help in the field's metadata): `TrainConfig`, the training settings, which the recipes (YAML files of
any of its fields) also give; and `RunOptions`, how `sparsify convert` runs besides them (where it reads and
writes, the device, what it reports). Imports no torch, so that the command starts and shows its help at once."""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import get_args, get_origin, get_type_hints


from .errors import ConfigError

# An absolute coefficient depends on the model's activation scale (the paper's 1.5B model: 2e-5; the 3M-parameter
# demo: 8e-2); above 1 the L1 term swamps the cross-entropy of any model. A relative one (`l1_relative`) is the
# penalty's initial weight in nats: beyond 100 it is 30 times any language model's cross-entropy.
MAX_L1 = 1.0
MAX_L1_RELATIVE = 100.0
# A relative weight below this barely sparsifies (recipes: 3.5): such a value is an absolute coefficient given
# without --l1-absolute
MIN_L1_RELATIVE = 0.01
# A layer on the hybrid kernels goes back to dense only above this multiple of `hybrid_below`, so that a layer
# whose activity hovers around the threshold does not flip at every check.
HYBRID_EXIT = 1.25
LAUNCHER_GRACE_S = 30  # accelerate launch and torchrun kill their processes this long after a Ctrl-C


def close_names(typed: str, names: list[str]) -> list[str]:
    """The `names` whose words are closest to those of the mistyped `typed` (the most shared against all that
    either has: --lr-rate: --lr; --l1-weight: --l1; learning_rate: lr; --calibrate-step: the --calibrate ones),
    where a spelling match finds unrelated ones (--private, --weight-decay); none where no word is shared. Words
    are the parts between dashes or underscores, a negation's "no" aside, and the initials of a typed name of
    several (--learning-rate: lr)."""
    def words(name: str) -> list[str]:
        return [word for word in re.split(r"[-_]+", name.lstrip("-")) if word not in ("", "no")]

    typed_words = words(typed)
    wanted = {*typed_words, "".join(word[0] for word in typed_words)} if len(typed_words) > 1 else set(typed_words)
    closeness = {name: len(wanted & set(words(name))) / len(wanted | set(words(name))) for name in names}
    best = max(closeness.values(), default=0)
    return sorted(name for name, close in closeness.items() if best and close == best)


def value_type(hint) -> type:
    """The type of a setting's values, from its field's type `hint`: tuple for tuple[...], else the hint's first
    type other than None (int | None: int; int | str, a count or a share: int)."""
    if get_origin(hint) is tuple:
        return tuple
    return next(kind for kind in get_args(hint) or (hint,) if kind is not type(None))


def option_name(name: str) -> str:
    """The command-line option of setting `name`, as messages name a setting: a recipe's keys are the options too."""
    return "--" + name.replace("_", "-")


def _setting(default, help_text: str, **cli):
    """A field of TrainConfig or RunOptions: its default (MISSING: a required option), its help, and how the
    command line spells it where the field's name and type do not say (`flag`: the option's declarations,
    space-separated, as "-o --out" or a boolean's "--on/--off"; `metavar`; `unset`: what a default of None
    stands for, as --help shows it; `folder`: the value names a folder; `section`: the part of `sparsify convert
    --help` that lists the option, a key of cli.HELP_SECTIONS; without one, the advanced settings)."""
    return field(default=default, metadata={"help": help_text, **cli})


@dataclass
class TrainConfig:
    """Training settings; a recipe YAML holds any of these keys, command-line options override it."""

    l1: float = _setting(2e-5, (
        "L1 weight on the MLP hidden activations: with --l1-relative (the pretrained recipe, the default) the "
        "penalty's initial weight in nats (recipe: 3.5); with --l1-absolute the coefficient (paper: 2e-5)."),
        section="main")
    l1_relative: bool = _setting(False, (
        "Read --l1 as the weight of L1 / L1_0, L1_0 the L1 term of the first micro-batch (mean over processes): "
        "the penalty's weight in nats at the start, the same for any width and activation scale; or as the "
        "absolute coefficient."), flag="--l1-relative/--l1-absolute")
    l1_warmup_steps: int | str = _setting(0, (
        "Raise the L1 coefficient linearly from 0 over this many optimizer steps, or this share of them (50%)."),
        metavar="STEPS|P%", section="main")
    target_sparsity: float = _setting(0.0, (
        "Steer the L1 weight so that the share of the MLP units not firing for a token (the mean over layers) "
        "reaches this (such as 0.99) at the end of the L1 warm-up and holds it: the units allowed to fire fall "
        "geometrically from the first log step's to the target's over the warm-up, and at each log step the weight "
        "is multiplied up while the model fires more and down while it fires fewer, by up to e-fold in a tenth of "
        "the run, between a tenth of --l1 and 10 times it. A fixed weight holds less sparsity on a better-trained "
        "model; a short L1 warm-up (12.5%) suits it (docs/quality.md). 0: --l1 throughout."),
        metavar="SHARE", section="main")
    l1_log_scale: float = _setting(0.0, (
        "The penalty's shape. 0: L1, the sum over the MLP units of |h|. S > 0: the log penalty, the sum of "
        "eps * log(1 + |h| / eps), eps S times the layer's mean |h| over its firing units at the first step (with "
        "--calibrate-steps, on the swapped layer before its fit): it pushes activations small against eps to zero "
        "as L1 does and the large ones, which carry the layer's output, far less."), metavar="SCALE", section="main")
    swap_steps: int | str = _setting(0, (
        "Move the gate activation linearly from the source's (SiLU) to ReLU over this many optimizer steps, or "
        "this share of them (20%), instead of swapping it at once (0). Layers train dense until the swap is "
        "complete."), metavar="STEPS|P%")
    steps: int | None = _setting(None, "Optimizer steps; with --tokens, whichever ends first.", unset="no limit",
                                  section="budget")
    tokens: int | None = _setting(None, (
        "Training tokens; with --steps, whichever ends first; more than the text holds trains on it again (--passes "
        "counts them for you). What a conversion needs follows the share of the source's pretraining tokens it "
        "trains on, not a count: the default recipe keeps quality on a quarter of them (a source trained longer: "
        "--recipe small-budget --passes 3); on a few percent, --recipe small-budget with --passes 4 to 8 over the text "
        "and three times as much sampled from the source (README's table; the figures: docs/quality.md)."),
        unset="no limit", section="budget")
    passes: float | None = _setting(None, (
        "Training tokens as passes over the training text (the text after its held-out part): N times its tokens, "
        "such as 2 or 1.5, in place of --tokens (and of a recipe's tokens); with --steps (also a recipe's: the demo "
        "recipe sets 400), whichever ends first. Local text only, counted before training: beyond its first 4.2M "
        "tokens its length is read and its tokens estimated from it, and the count is said as \"about\"."),
        metavar="N", unset="off", section="budget")
    seq_len: int = _setting(1024, "Tokens per training sequence (packed blocks).", section="main")
    batch_size: int = _setting(8, "Sequences per micro-batch and device.", section="main")
    grad_accum: int = _setting(1, "Micro-batches accumulated per optimizer step.", section="main")
    lr: float = _setting(2e-5, "Peak learning rate (AdamW, cosine schedule).", section="main")
    mlp_lr: float | None = _setting(None, (
        "Peak learning rate of the MLP weights (gate, up and down projections) where it differs from --lr: the "
        "MLPs sparsify at a high rate while the rest of the model stays near its trained minimum at a low one."),
        unset="--lr")
    weight_decay: float = _setting(0.0, "AdamW weight decay.")
    betas: tuple[float, float] = _setting((0.9, 0.95), "AdamW betas.")
    warmup_steps: int = _setting(0, "Linear learning-rate warm-up steps before the cosine decay.")
    max_grad_norm: float = _setting(1.0, "Gradient clipping norm.")
    grad_checkpointing: bool = _setting(False, "Recompute activations in the backward to save memory.", section="main")
    fused_decoder: bool = _setting(True, (
        "On CUDA, run the decoder's RMSNorms and rotary embedding on twell's kernels (forward and backward: the "
        "checkpoint's own at inference), which keep less for the backward than transformers' modules; "
        "--no-fused-decoder: transformers' modules."), flag="--fused-decoder/--no-fused-decoder")
    chunked_loss: bool = _setting(True, (
        "Compute the LM head's logits, the cross-entropy and the distillation KL a chunk of tokens at a time, "
        "forward and backward, so that no [tokens, vocabulary] logits or gradient exist whole (each fp32 copy "
        "3.2 GB at 8 x 2048 tokens and a vocabulary of 49152; the whole-logits loss keeps several, more with "
        "--distill), for one more head matmul a step (two with --distill). A micro-batch whose fp32 logits fit in "
        "one chunk (256 MiB) takes the whole logits, as do models whose forward changes the logits after the "
        "head (Gemma 2's soft-capping). --no-chunked-loss: the whole logits, as transformers computes them."),
        flag="--chunked-loss/--no-chunked-loss")
    hybrid_below: float = _setting(40.0, (
        "Train a layer's MLP on the TwELL hybrid kernels while its mean active units per token are below this "
        f"(back to dense above {HYBRID_EXIT}x it), re-checked at every log step; on CUDA with triton only; 0: "
        "always dense. The default lies below the activity at which those kernels stop being faster than the "
        "dense path."), metavar="UNITS")
    hybrid_max_nnz: int = _setting(128, (
        "E of the hybrid format: token rows with more active units run in the dense backup (paper: 128)."))
    hybrid_hot_rate: float = _setting(0.013, (
        "On the hybrid path, units that fired in more than this share of the last step's tokens run as dense "
        "columns (re-chosen at every log step; 1: never). The default is the rate above which a dense column "
        "costs less than per-pair gathers."))
    dead_window_tokens: int | None = _setting(None, (
        "A unit is dead when it has not fired in this many tokens."), unset="one optimizer step's tokens")
    revive_dead_tokens: int | None = _setting(None, (
        "At each log step but the last, split a live unit of its layer into each MLP unit silent for this many "
        "tokens, keeping the layer's output, so that it trains again (docs/quality.md, \"Dead units revived\")."),
        unset="off")
    shuffle_buffer: int = _setting(1024, (
        "Training blocks drawn at random from a buffer of this many (0: the data's own order)."))
    eval_tokens: int = _setting(65536, (
        "Held-out tokens to measure perplexity and sparsity on: a folder's valid* / eval* / test* files, else the "
        "head of the training text, never trained on."))
    seed: int = _setting(0, "Random seed.")
    log_every: int = _setting(10, "Log (JSON and progress line) every this many optimizer steps.")
    distill: float = _setting(0.0, (
        "Fit the source model's next-token distributions too: (1 - WEIGHT) * CE + WEIGHT * KL(source || "
        "trained) at every position, the source a frozen copy of the original model (one more forward a "
        "micro-batch; its weights whole in bf16 on each GPU, also under FSDP). 0: off."),
        metavar="WEIGHT", section="main")
    distill_temperature: float = _setting(1.0, (
        "Temperature of both distributions in --distill's KL term, the term scaled by its square so that its "
        "gradients keep their size: above 1 weighs the source's less likely tokens more. 1: as they are."))
    distill_hidden: float = _setting(0.0, (
        "Fit the source model's hidden states too: WEIGHT * the mean over decoder layers of ||h - h_source||^2 / "
        "||h_source||^2 (each layer's output, summed over the positions): a signal at every layer, where --distill "
        "fits the output distributions only (docs/quality.md measures both); the source as for --distill. 0: off."),
        metavar="WEIGHT")
    calibrate_steps: int = _setting(0, (
        "Before training, fit each layer's ReLU MLP alone to the source's MLP (their inputs and outputs on the first "
        "--calibrate-tokens of the training text) by this many Adam steps, so that training starts near the source "
        "instead of recovering from the swap. 0: off. The swap is then done when training starts: --swap-steps 0. "
        "Several processes (DDP) share the layers; not under FSDP."),
        metavar="STEPS")
    calibrate_tokens: int = _setting(65536, (
        "Tokens whose MLP inputs and outputs calibration fits: the first blocks of the training text, trained on "
        "again."))
    calibrate_lr: float | None = _setting(None, "Peak learning rate of calibration (Adam, cosine to 0).",
                                          unset="--lr")
    calibrate_sparsity: float = _setting(0.0, (
        "Calibration's target share of each layer's units that do not fire for a token (such as 0.99): the fit "
        "adds the training's penalty (L1 or the log penalty) with a weight steered to reach it, so that training "
        "starts sparse. 0: a dense fit."),
        metavar="SHARE")
    calibrate_sequential: bool = _setting(False, (
        "Fit the layers bottom up, each on the inputs that the layers below it, already fitted, give it, to the "
        "source's residual stream after it (so that a layer takes up what the ones below it left), instead of each "
        "alone on the source's inputs to the source's MLP. Keeps the source's MLP projections in CPU memory."),
        flag="--calibrate-sequential/--calibrate-independent")
    save_every_minutes: float = _setting(30.0, (
        "Also save the training state to OUT.resume/ when this many minutes have passed since the start or the "
        "last save (0: off), so that a crash or a killed job loses at most that much."), metavar="MINUTES")
    save_every: int = _setting(0, (
        "Also save the training state to OUT.resume/ every this many optimizer steps (0: only on Ctrl-C or "
        "SIGTERM), for runs that may be killed without time to save: a preempted job, or a large sharded state "
        f"under `accelerate launch`, which kills its processes {LAUNCHER_GRACE_S} s after Ctrl-C."), metavar="STEPS")

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """From a recipe's or the command line's values, with YAML's quirks mended ("2e-5" reads as a
        string in YAML 1.1, "1e9" tokens as a float)."""
        hints = get_type_hints(cls)
        if problem := unknown_settings(values):
            raise ConfigError(problem)
        config = {}
        for name, value in values.items():
            kind = value_type(hints[name])
            try:
                if isinstance(value, bool) and kind is not bool:  # YAML's true/false is no number
                    raise TypeError
                if name in SHARE_OF_STEPS and _percent(str(value).strip()) is not None:
                    value = str(value).strip()
                elif kind is float:
                    value = float(value)
                elif kind is int and float(value) == int(float(value)):
                    value = int(float(value))
                elif kind is tuple:
                    value = tuple(float(v) for v in value)
            except (TypeError, ValueError):
                share = " or a share of the run's steps such as 50%" if name in SHARE_OF_STEPS else ""
                raise ConfigError(f"{option_name(name)}: {value!r} is not {'an' if kind is int else 'a'} "
                                  f"{kind.__name__}{share}") from None
            config[name] = value
        return cls(**config)

    def tokens_per_step(self, world: int = 1) -> int:
        return self.seq_len * self.batch_size * self.grad_accum * world

    def total_steps(self, world: int = 1) -> int:
        if self.passes is not None and self.tokens is None:
            raise ValueError("--passes must be resolved into tokens from the training text first (convert does)")
        bounds = [self.steps] if self.steps is not None else []
        if self.tokens is not None:
            bounds.append(math.ceil(self.tokens / self.tokens_per_step(world)))
        return min(bounds)

    def validate(self, max_positions: int | None = None, world: int | None = None) -> None:
        """ConfigError for impossible settings, named by their options; with `max_positions`, a seq-len beyond the
        model's; with `world` (processes), a ReLU swap that would not end within the run's steps; a revival window
        below a step's tokens on `world` processes, or one where not given."""
        def bad(name, problem):
            raise ConfigError(f"{option_name(name)} {problem}")

        if self.l1_relative:
            if not (isinstance(self.l1, (int, float)) and 0 <= self.l1 <= MAX_L1_RELATIVE):
                bad("l1", f"(relative) must be between 0 and {MAX_L1_RELATIVE} (the initial weight of the L1 term "
                    f"in nats), got {self.l1}")
            if 0 < self.l1 < MIN_L1_RELATIVE:
                bad("l1", f"(relative) {self.l1:g} is the L1 term's initial weight in nats, too small to sparsify "
                    f"(recipes: 3.5); for an absolute coefficient such as the paper's 2e-5 add --l1-absolute")
        elif not (isinstance(self.l1, (int, float)) and 0 <= self.l1 <= MAX_L1):
            bad("l1", f"must be between 0 and {MAX_L1} as an absolute coefficient (the paper uses 2e-5), got "
                f"{self.l1}; for the L1 term's initial weight in nats (recipes: 3.5) add --l1-relative")
        self._check_length()
        for name in ("steps", "tokens", "seq_len", "batch_size", "grad_accum", "log_every", "dead_window_tokens",
                     "revive_dead_tokens", "eval_tokens", "hybrid_max_nnz", "calibrate_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                bad(name, f"must be a positive integer, got {value}")
        for name in ("warmup_steps", "shuffle_buffer", "save_every", "calibrate_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                bad(name, f"must be an integer >= 0, got {getattr(self, name)}")
        for name in SHARE_OF_STEPS:
            value = getattr(self, name)
            share = _percent(value)
            if not (isinstance(value, int) and value >= 0 or share is not None and 0 <= share < 100):
                bad(name, f"must be an integer >= 0 or a share of the steps below 100%, got {value}")
        for name, zero in (("l1_log_scale", "L1"), ("hybrid_below", "dense only"), ("save_every_minutes", "off"),
                           ("distill_hidden", "off")):
            if not 0 <= getattr(self, name) < math.inf:
                bad(name, f"must be a number >= 0 (0: {zero}), got {getattr(self, name)}")
        for name in ("lr", "mlp_lr", "calibrate_lr"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                bad(name, f"must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.calibrate_sparsity < 1:
            bad("calibrate_sparsity", f"must be in [0, 1) (a share of units, such as 0.99), got "
                f"{self.calibrate_sparsity}")
        if not 0 <= self.target_sparsity < 1:
            bad("target_sparsity", f"must be in [0, 1) (a share of units, such as 0.99; 0: off), "
                f"got {self.target_sparsity}")
        if self.target_sparsity and not self.l1:
            bad("target_sparsity", "steers the L1 weight: set --l1 above 0")
        if self.calibrate_sparsity and not self.calibrate_steps:
            bad("calibrate_sparsity", "sets the calibration's target: set --calibrate-steps too")
        if self.calibrate_sequential and not self.calibrate_steps:
            bad("calibrate_sequential", "sets how calibration fits: set --calibrate-steps too")
        if self.calibrate_steps and (_percent(self.swap_steps) if isinstance(self.swap_steps, str)
                                     else self.swap_steps):
            bad("calibrate_steps", f"fits the ReLU MLPs before training, so the swap is done when training starts: "
                f"set --swap-steps 0 (it is {self.swap_steps})")
        if not 0 < self.hybrid_hot_rate <= 1:
            bad("hybrid_hot_rate", f"must be in (0, 1], got {self.hybrid_hot_rate}")
        if not 0 <= self.weight_decay <= 1:
            bad("weight_decay", f"must be in [0, 1], got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            bad("betas", f"must be two numbers in [0, 1) (AdamW's), got {self.betas}")
        if not self.max_grad_norm > 0:
            bad("max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        if not 0 <= self.distill <= 1:
            bad("distill", f"must be in [0, 1] (the share of the KL term; 0: off), got {self.distill}")
        if not 0 < self.distill_temperature < math.inf:
            bad("distill_temperature", f"must be a number above 0, got {self.distill_temperature}")
        elif self.distill_temperature != 1 and not self.distill:
            bad("distill_temperature", "sets --distill's KL term: set --distill too")
        if self.seq_len < 2:
            bad("seq_len", f"must be at least 2, got {self.seq_len}")
        if max_positions is not None and self.seq_len > max_positions:
            bad("seq_len", f"{self.seq_len} is beyond the model's maximum of {max_positions} positions")
        if world is not None:
            self.check_processes(world)
        else:
            self.check_revive(1)

    def _check_length(self) -> None:
        """ConfigError where the run's length is unset, or --passes is no count of passes or comes with --tokens."""
        if self.steps is None and self.tokens is None and self.passes is None:
            raise ConfigError("set the training length: --steps, --tokens or --passes (or a recipe that sets them)")
        if self.passes is not None and self.tokens is not None:
            raise ConfigError(f"--passes {self.passes:g} and --tokens {self.tokens} both set the training tokens (on "
                              "the command line or in one recipe): give one (--passes N trains on N times the training "
                              "text's tokens)")
        if self.passes is not None and not 0 < self.passes < math.inf:
            raise ConfigError(f"--passes must be a number above 0 (passes over the training text, such as 2 or 1.5), "
                              f"got {self.passes:g}")

    def check_processes(self, world: int) -> None:
        """ConfigError for what `world` processes cannot run: a ReLU swap that would not end within the run's steps,
        a revival window below a step's tokens, sequential calibration on several. Needs the run's length: --passes
        resolved into tokens."""
        self.check_swap(world)
        self.check_revive(world)
        if self.calibrate_steps and self.calibrate_sequential and world > 1:
            raise ConfigError(f"--calibrate-sequential runs on one process, not {world}: each layer's fit needs the "
                              "ones below it (without it, calibration spreads the layers over the processes)")

    @property
    def uses_teacher(self) -> bool:
        """Whether training reads a frozen copy of the source model (distillation of outputs or hidden states)."""
        return self.distill > 0 or self.distill_hidden > 0

    def check_revive(self, world: int) -> None:
        """ConfigError unless --revive-dead-tokens (if set) spans at least one optimizer step's tokens on `world`
        processes: training counts each unit's firing per step, so a shorter window would stand for one step's."""
        step_tokens = self.tokens_per_step(world)
        if self.revive_dead_tokens is not None and self.revive_dead_tokens < step_tokens:
            processes = f" x {world} processes" if world > 1 else ""
            raise ConfigError(f"--revive-dead-tokens {self.revive_dead_tokens} is below one optimizer step's "
                              f"{step_tokens:,} tokens (--seq-len x --batch-size x --grad-accum{processes}): units' "
                              "firing is counted per step")

    def check_swap(self, world: int) -> None:
        """ConfigError unless the ReLU swap ends within the run's steps on `world` processes: the trained model
        must be the ReLU model that the export describes."""
        total = self.total_steps(world)
        if self.schedule(total).swap_steps >= total:
            raise ConfigError(f"--swap-steps {self.swap_steps} must be below the {total} training steps")

    def warnings(self, world: int, tokens_asked: bool = True) -> list[str]:
        """Settings that run but defeat themselves on `world` processes: a token count that the steps cut short
        (--tokens on a recipe that sets steps; none where not `tokens_asked`: a recipe's count under --steps given,
        which the user chose to end first), a warm-up that does not end within the run (a short run with a recipe's
        warm-ups, say)."""
        total = self.total_steps(world)
        resolved = self.schedule(total)
        found = []
        if tokens_asked and self.tokens is not None and total * self.tokens_per_step(world) < self.tokens:
            asked = (f"--passes {self.passes:g} ({self.tokens:,} tokens)" if self.passes is not None
                     else f"--tokens {self.tokens:,}")
            needed = math.ceil(self.tokens / self.tokens_per_step(world))
            found.append(f"{asked}: the run stops at its {steps_said(total)} first, after "
                         f"{total * self.tokens_per_step(world):,} tokens (--steps {needed} trains on all of them)")
        for name, what in (("warmup_steps", "the learning rate"), ("l1_warmup_steps", "the L1 weight")):
            if getattr(resolved, name) >= total:
                flag = option_name(name)
                fix = (f"a share of the run, such as {flag} 12.5%, scales with it" if name in SHARE_OF_STEPS
                       else f"fewer steps, such as {flag} {total // 8}")  # it takes a count only, no share
                found.append(f"{flag} {getattr(self, name)} is not below the run's {steps_said(total)}: "
                             f"{what} never reaches its set value ({fix})")
        return found

    def schedule(self, total: int) -> TrainConfig:
        """This config with the step counts given as a share of the run ("20%") resolved for `total` steps."""
        return replace(self, **{name: steps_of(getattr(self, name), total) for name in SHARE_OF_STEPS})


TEXT_COLUMN_HELP = "The column of .jsonl/.parquet rows and `datasets` rows that holds the text"
# what `sparsify bench` says a CPU can do instead (before torch is imported, and after)
BENCH_ON_CPU = " (a CPU runs every layer dense: `sparsify analyze CHECKPOINT --data TEXT` measures its sparsity there)"


def measure_help(what: str) -> str:
    """The help of --measure/--no-measure, for a command that does `what` with it."""
    return (f"{what} by timing the candidates on this GPU (CUDA only), or by the cost model. Default: timed on a GPU "
            "where the layers are narrower than the cost model's shapes (hidden size 896, 4864 units), which it "
            "would plan dense.")


@dataclass
class RunOptions:
    """How a conversion runs besides its training settings: `sparsify convert`'s other options, one field each."""

    out: str | Path = _setting(MISSING, "Output checkpoint folder.", flag="-o --out", folder=True, section="io")
    data: str | None = _setting(None, (
        "Training text: .txt/.json/.jsonl/.parquet file(s) or folder, or a `datasets` name as NAME[:CONFIG][@SPLIT]. "
        "Default for demo: the demo corpus."), section="io")
    text_column: str = _setting("text", TEXT_COLUMN_HELP + ".", metavar="NAME", section="io")
    device: str | None = _setting(None, (
        "cpu or cuda (default: cuda if available). Several GPUs: `accelerate launch -m cli convert ...`."),
        section="run")
    resume: bool = _setting(False, "Continue an interrupted conversion from OUT.resume/.", section="run")
    overwrite: bool = _setting(False, (
        "Replace OUT if it exists and is not empty, and start over where OUT.resume/ holds an interrupted run."),
        section="run")
    max_shard_size: str = _setting("5GB", "Largest safetensors shard.", section="io")
    push_to_hub: str | None = _setting(None, (
        "Upload OUT to this Hub repository (created if needed; files of an earlier upload that OUT lacks are "
        "deleted). Needs a Hub login: `hf auth login`, or a token in HF_TOKEN."), metavar="REPO_ID", section="io")
    private: bool = _setting(False, "With --push-to-hub: make a new repository private.", section="io")
    measure_kernels: bool | None = _setting(None, measure_help("Choose each layer's kernel setting"),
                                            flag="--measure/--no-measure")
    dry_run: bool = _setting(False, (
        "Check everything a run checks before reading weights (OUT, the data, the settings against the model's "
        "config, its weight files' sizes, its tokenizer, the GPUs' memory), print the resolved settings, the "
        "training state's size and the held-out text, and stop."), section="run")
    report_to: str = _setting("none", (
        "Send the training log's figures at each log step to these accelerate trackers, separated by commas: "
        "tensorboard (into OUT.logs/, a folder per run; pip install tensorboard), wandb (pip install wandb), any "
        "other that accelerate supports, all (those installed) or none."), metavar="TRACKERS", section="run")
    quiet: bool = _setting(False, "No progress bars, log lines or settings: only warnings, errors and the final "
                                  "summary.", flag="-q --quiet", section="run")


@dataclass
class SampleOptions:
    """`sparsify sample`'s options, one field each (sparsify/sample.py)."""

    out: str | Path = _setting(MISSING, "Output data folder (train.jsonl, valid.jsonl, sample.yaml).", flag="-o --out",
                               folder=True)
    tokens: int = _setting(MISSING, "Tokens to sample, prompts included.")
    data: str | None = _setting(None, (
        "Text whose training blocks give the prompts, and whose held-out text the folder keeps for evaluation (as "
        "for convert). Default for demo: the demo corpus."))
    text_column: str = _setting("text", TEXT_COLUMN_HELP + ".", metavar="NAME")
    prompt_tokens: int = _setting(32, "Tokens of each prompt: the head of one training block of --data.")
    seq_len: int | None = _setting(None, "Tokens of a sample at most, its prompt included (it ends earlier at EOS).",
                                   unset="1024, or the source's positions where fewer")
    temperature: float = _setting(1.0, (
        "Sampling temperature: 1 draws from the source's own distribution, which distillation then fits."))
    batch_size: int | None = _setting(None, "Samples generated together.", unset=(
        "what fits: on a GPU the samples whose caches fill half its free memory, at most 1024; on a CPU 32; at most "
        "the samples --tokens takes"))
    with_data: bool = _setting(False, (
        "Also write --data's training documents, spread evenly among the samples by tokens, so that a conversion "
        "trains on both."))
    eval_tokens: int = _setting(65536, (
        "Held-out tokens of --data to keep where it has no valid* / eval* / test* file (as for convert)."))
    seed: int = _setting(0, "Random seed of the sampling.")
    device: str | None = _setting(None, "cpu or cuda (default: cuda if available).")
    overwrite: bool = _setting(False, "Replace OUT if it exists and is not empty.")

    def validate(self, positions: int | None) -> None:
        """ConfigError naming each impossible value; `positions`: the source's max_position_embeddings. seq_len
        is set (fit_seq_len); batch_size may be None (sample.fitted_batch sets it once the model is loaded)."""
        found = [f"{option_name(name)} must be a positive integer, got {getattr(self, name)}"
                 for name in ("tokens", "prompt_tokens", "seq_len", "batch_size", "eval_tokens")
                 if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.prompt_tokens >= self.seq_len:
            found.append(f"--prompt-tokens {self.prompt_tokens} leaves nothing to sample within --seq-len "
                         f"{self.seq_len}")
        if positions is not None and self.seq_len > positions:
            found.append(f"--seq-len {self.seq_len} is beyond the source's {positions} positions")
        if not self.temperature > 0:
            found.append(f"--temperature must be above 0, got {self.temperature}")
        if found:
            raise ConfigError("; ".join(found))

    def fit_seq_len(self, positions: int | None) -> SampleOptions:
        """These options with seq_len set where it is not: SAMPLE_SEQ_LEN, or the source's `positions` where fewer."""
        if self.seq_len is not None:
            return self
        return replace(self, seq_len=min(SAMPLE_SEQ_LEN, positions or SAMPLE_SEQ_LEN))


SAMPLE_SEQ_LEN = 1024  # sparsify sample's longest sample where --seq-len is not given and the source has the positions


# Schedule lengths that a recipe may give as a share of the training steps ("20%"), so that it fits any length.
SHARE_OF_STEPS = ("l1_warmup_steps", "swap_steps")


def _percent(value) -> float | None:
    """P of a "P%" string; None for anything else."""
    try:
        return float(value[:-1]) if isinstance(value, str) and value.endswith("%") else None
    except ValueError:
        return None


def steps_of(value: int | str, total: int) -> int:
    """A step count, or a share of `total` steps written "P%", as a step count."""
    return round(total * float(value[:-1]) / 100) if isinstance(value, str) else value


def unknown_settings(names) -> str | None:
    """What says which of `names` are no training setting, each with the settings close to it (learning_rate: lr),
    and all of them where one has none close; None where all are settings."""
    known = sorted(setting.name for setting in fields(TrainConfig))
    unknown = sorted(set(names) - set(known))
    if not unknown:
        return None
    close = {name: close_names(name, known) for name in unknown}
    said = ", ".join(f"{name} (did you mean {' or '.join(close[name])}?)" if close[name] else name for name in unknown)
    listed = "" if all(close.values()) else f" (known: {', '.join(known)})"
    return f"unknown training settings: {said}{listed}"


LENGTHS = ("tokens", "passes")  # either sets the run's training tokens


def steps_said(steps: int) -> str:
    return f"{steps:,} step" + ("s" if steps != 1 else "")


def shown_value(value) -> str:
    """A setting's value as the settings line says it: counts with thousands separators, floats short."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def overlay(settings: dict, values: dict) -> dict:
    """Training `settings` with `values` over them (a recipe's over the one it extends, the command line's over the
    recipe's): a length in `values` (tokens or passes) replaces the one `settings` set."""
    if values.keys() & set(LENGTHS):
        settings = {name: value for name, value in settings.items() if name not in LENGTHS}
    return {**settings, **values}
