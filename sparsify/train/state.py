"""What the loop carries: the prepared run (Run), where it stands (RunState: what a save writes), a step's
outcome, and what train returns."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from accelerate import Accelerator

from ..config import TrainConfig
from ..errors import Interrupted
from ..resume import load_last_fired


class TrainingInterrupted(Interrupted):
    """Ctrl-C or SIGTERM during training: the state was saved and `--resume` continues from it."""


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    log: list[dict]
    # The trained model in eval mode: the one passed in, or under FSDP (`sharded`) the prepared model whose
    # weights are sharded over the processes (gather_model makes a whole one).
    model: torch.nn.Module | None = None
    sharded: bool = False
    # Where a later stage fails: saves the finished run's state for --resume (which then goes straight to
    # measuring) where it can, and says where it is (Saver.after_training_error)
    save: Callable[[], None] = lambda: None


@dataclass
class Run:
    """A prepared run: what setup makes and the steps, the log and the saves read."""

    accelerator: Accelerator
    model: torch.nn.Module  # as accelerate prepared it
    mlps: list
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainConfig
    schedule: TrainConfig  # `config` with its shares of the steps resolved (TrainConfig.schedule)
    total: int  # optimizer steps
    teacher: torch.nn.Module | None  # on this process's device, frozen; None without distillation
    routes: bool  # whether layers may move to the hybrid kernels

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


@dataclass
class RunState:
    """Where the run stands: what a save writes and a resumed run reads back, and when it started."""

    started: float  # time.perf_counter() at the start, less the seconds of the run before a resume
    step: int = 0
    batches: int = 0  # read over all processes
    log: list[dict] = field(default_factory=list)
    l1_reference: float | None = None  # L1_0 of `l1_relative`: given to train, else measured on the first micro-batch
    l1_scale: float = 1.0  # the L1 weight's factor that `target_sparsity` steers (loss.steered_l1_scale)
    # each layer's eps of the log penalty (l1_log_scale): given, else the first step's
    l1_eps: list[float] | None = None
    last_fired: torch.Tensor | None = None  # [layers, I]: the token count at each unit's last firing
    data_position: dict | None = None  # the batch stream's state_dict after `batches`, where it has one
    # False while the weights are ahead of this state (from a step's update to its count and units' firing)
    # and during a save: then there is nothing consistent to save
    settled: bool = True

    @classmethod
    def resumed(cls, accelerator: Accelerator, resume_dir, saved: dict) -> RunState:
        """The state saved in `resume_dir` (`saved`: its state.json), loading the weights, optimizer, scheduler
        and RNG into the prepared objects."""
        accelerator.load_state(resume_dir)
        return cls(started=time.perf_counter() - saved["seconds"], step=saved["step"], batches=saved["batches"],
                   log=saved["log"], l1_reference=saved["l1_reference"], l1_scale=saved["l1_scale"],
                   l1_eps=saved["l1_eps"],
                   last_fired=load_last_fired(resume_dir, accelerator.device))


class StepOutcome(NamedTuple):
    fired: torch.Tensor  # [layers, I]: tokens in which each unit fired, summed over micro-batches and processes
    l1_coeff: float  # l1_coeff() of the step, times the steered l1_scale
    l1_weight: float  # the factor of the L1 term: l1_coeff, or l1_coeff / L1_0 with l1_relative
    source_share: float | None  # the gate's share of the source activation; None without a progressive swap
