"""The training loss: its terms (LossTerms: cross-entropy, the distillation terms against the source model, the
L1 penalty on the MLP hidden activations), each term's weight (term_weights), the schedules of the L1
coefficient and of the progressive ReLU swap, and the L1 weight's steering towards a sparsity. A new term is a
LossTerms field, its weight in term_weights (a TrainConfig setting), its column in TERM_COLUMNS and its
computation in loss_terms; the log, the log window, the trackers and the progress line follow from the fields."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import TrainConfig
from .head_loss import chunked_head, spans_chunks, whole_logits


def distillation_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, both at `temperature` and the KL scaled by its
    square (so that its gradients keep their size), summed over the vocabulary and averaged over the positions,
    in fp32."""
    target = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, -2)
    return temperature ** 2 * F.kl_div(F.log_softmax(logits.float() / temperature, dim=-1).flatten(0, -2), target,
                                       log_target=True, reduction="batchmean")


def hidden_distance(hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The mean over decoder layers of ||h - h_teacher||^2 / ||h_teacher||^2, each layer's output (the last one
    after the final norm, as transformers returns it) summed over the positions, in fp32 (the embeddings,
    hidden[0], are the teacher's own and left out)."""
    distances = [(h.float() - t.float()).pow(2).sum() / t.float().pow(2).sum().clamp_min(1e-12)
                 for h, t in zip(hidden[1:], teacher_hidden[1:], strict=True)]
    return torch.stack(distances).mean()


def l1_coeff(config: TrainConfig, step: int) -> float:
    """Coefficient at optimizer step `step` (0-based): linear from l1/warm-up to l1, then constant (relative
    to L1_0 with `l1_relative`); `config` with its step counts resolved (TrainConfig.schedule)."""
    if config.l1_warmup_steps == 0:
        return config.l1
    return config.l1 * min(1.0, (step + 1) / config.l1_warmup_steps)


# The steered L1 weight (target_sparsity) moves by up to this many e-folds over the whole run, within this range of
# the set weight: fast enough to follow the path of allowed units down a warm-up of a tenth of the run, and bounded
# so that an unreachable target cannot let the penalty swamp the cross-entropy.
L1_STEER_EFOLDS = 10.0
L1_SCALE_RANGE = (0.1, 10.0)


def allowed_active(config: TrainConfig, step: int, start_step: int, start_active: float, units: float) -> float:
    """The firing units a token that `target_sparsity` allows at optimizer step `step`: from `start_active` (the
    first log entry's, at `start_step`) falling geometrically to (1 - target_sparsity) * `units` at the end of the
    L1 warm-up, then that; `config` resolved as for l1_coeff. The warm-up sets how fast the model sparsifies, and
    the rest of the run trains at the target."""
    final = (1 - config.target_sparsity) * units
    end = config.l1_warmup_steps
    if step >= end or start_step >= end or start_active <= final:
        return final
    return start_active * (final / start_active) ** ((step - start_step) / (end - start_step))


def activity_error(active: float, allowed: float) -> float:
    """The log of the ratio of the firing units to the allowed ones, clamped to [-1, 1]: how far and which way an
    L1 weight steered to a sparsity moves (training's factor, calibration's multiplier)."""
    return max(-1.0, min(1.0, math.log(max(active, 1e-3) / allowed)))


def steered_l1_scale(scale: float, mean_active: float, allowed: float, steps: int, total: int) -> float:
    """The factor of the L1 weight after `steps` optimizer steps (of the run's `total`) at `mean_active` firing
    units a token where `allowed` may fire: multiplied by exp(L1_STEER_EFOLDS * steps / total * activity_error);
    within L1_SCALE_RANGE."""
    error = activity_error(mean_active, allowed)
    exponent = max(-50.0, min(50.0, L1_STEER_EFOLDS * steps / total * error))  # beyond, the range decides anyway
    low, high = L1_SCALE_RANGE
    return min(high, max(low, scale * math.exp(exponent)))


def source_share(config: TrainConfig, step: int) -> float:
    """Weight of the source activation in the gate at optimizer step `step` (0-based): 1 at the first step,
    falling linearly to 0 (plain ReLU) at `swap_steps`; `config` resolved as for l1_coeff."""
    return max(0.0, 1.0 - step / config.swap_steps) if config.swap_steps else 0.0


class LossTerms(NamedTuple):
    """The terms of the training loss, each a mean over tokens: a micro-batch's (tensors, for the backward) or a
    log window's (floats, means over its micro-batches and the processes)."""

    cross_entropy: torch.Tensor | float
    kl: torch.Tensor | float  # KL(teacher || model); 0 without distillation
    hidden: torch.Tensor | float  # hidden_distance to the teacher's; 0 without distill_hidden
    l1: torch.Tensor | float  # the mean over layers of each MLP's L1

    def loss(self, weights: LossTerms):
        """The loss training minimizes, the one expression for the backward and the log: each term times its
        weight (term_weights), summed in the fields' order."""
        weighted = [weight * term for weight, term in zip(weights, self, strict=True)]
        return sum(weighted[1:], weighted[0])


def term_weights(config: TrainConfig, l1_weight: float) -> LossTerms:
    """Each term's weight in the loss: the settings' (`config`), and the step's `l1_weight` (l1_coeff, relative to
    L1_0 with `l1_relative`)."""
    return LossTerms(cross_entropy=1 - config.distill, kl=config.distill, hidden=config.distill_hidden, l1=l1_weight)


class TermColumn(NamedTuple):
    """How the log shows a loss term."""

    label: str  # in the progress line
    spec: str  # the format of its value there
    weighted_only: bool  # logged only where its weight is not 0 (a teacher's term is computed only then)


TERM_COLUMNS = LossTerms(cross_entropy=TermColumn("ce", ".3f", False), kl=TermColumn("kl", ".3f", True),
                         hidden=TermColumn("hidden", ".3f", True), l1=TermColumn("L1", ".3g", False))


def logged_terms(terms: LossTerms, weights: LossTerms) -> dict:
    """A log entry's loss terms by name (a log window's `terms`, the `weights` of its last step): all but those
    logged only where weighted, at weight 0."""
    return {name: term for name, term, weight, column in zip(LossTerms._fields, terms, weights, TERM_COLUMNS)
            if weight or not column.weighted_only}


def shown_terms(entry: dict) -> str:
    """The loss terms of a log `entry` as the progress line shows them, each followed by two spaces."""
    return "".join(f"{column.label} {entry[name]:{column.spec}}  "
                   for name, column in zip(LossTerms._fields, TERM_COLUMNS) if name in entry)


def loss_terms(model, mlps: list, ids: torch.Tensor, teacher: torch.nn.Module | None,
               config: TrainConfig) -> tuple[LossTerms, torch.Tensor]:
    """A micro-batch's loss terms from the model's forward on `ids` (the distillation terms that `config` weighs
    from the `teacher`'s), and the per-layer L1 [layers] that `l1` averages. With `chunked_loss` the LM head and
    the CE and KL run in chunks of tokens (head_loss) where the logits span more than one, except where a model's
    forward transforms them."""
    hidden = config.distill_hidden > 0
    core = getattr(model, "module", model)  # DDP's wrapper holds the model as `module`
    chunked = (config.chunked_loss and not whole_logits(core) and spans_chunks(core, ids)
               and not (config.distill and whole_logits(teacher)))
    if teacher is not None:  # no KV cache, and the LM head's logits only where the KL takes them whole
        source = teacher if config.distill and not chunked else teacher.base_model
        with torch.no_grad():
            reference = source(input_ids=ids, output_hidden_states=hidden, use_cache=False)
    if chunked:
        teacher_head = (reference.last_hidden_state, teacher.get_output_embeddings().weight) if config.distill else ()
        with chunked_head(core, ids, *teacher_head, temperature=config.distill_temperature):
            output = model(input_ids=ids, output_hidden_states=hidden)
        cross_entropy, kl = output.logits  # chunked_head's terms in place of the logits
    else:
        output = model(input_ids=ids, labels=ids, output_hidden_states=hidden)
        cross_entropy = output.loss
        kl = distillation_kl(output.logits, reference.logits, config.distill_temperature) if config.distill else \
            torch.zeros_like(cross_entropy)
    distance = hidden_distance(output.hidden_states, reference.hidden_states) if hidden else \
        torch.zeros_like(cross_entropy)
    layer_l1 = torch.stack([m.stats.l1.float() for m in mlps])
    # returns without `output`: its logits ([batch, seq_len, vocab]) need not live through the backward
    return LossTerms(cross_entropy, kl, distance, layer_l1.mean()), layer_l1
