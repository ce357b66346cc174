"""Saving the training state for --resume (sparsify.resume) while training runs: on Ctrl-C or SIGTERM (agreed
between the processes at the end of each step), on a schedule, on an error, and after training where a later
stage fails."""
from __future__ import annotations

import signal
import threading
import time

import torch

from ..report import console
from ..resume import save_state
from .state import Run, RunState, TrainingInterrupted


class Saver:
    """Saves the training state to `resume_dir` (None: never): when the processes are asked to stop, every
    `save_every` steps, once `save_every_minutes` have passed since the last save, and on an error."""

    def __init__(self, run: Run, resume_dir, inputs: dict | None, before_training: dict | None, run_name: str,
                 progress, step: int):
        self.run, self.resume_dir, self.inputs, self.progress = run, resume_dir, inputs, progress
        self.before_training = before_training
        self.run_name = run_name  # the trackers' folder under logging_dir, which a resumed run keeps
        self.saved_step = step  # the step of the state in resume_dir, if any
        self.last_save = time.perf_counter()
        # An error after training can save in a single process; under FSDP the loop drops its optimizer state by
        # then, and with several processes no save can be collective: those save their last step.
        self.saves_after_training = run.world == 1 and not run.accelerator.is_fsdp2

    def save(self, state: RunState) -> None:
        progress = self.progress  # reported: a large sharded state is long to write
        if progress:
            progress.console.print(f"step {state.step}: saving the training state to {self.resume_dir}")
        saving, state.settled = time.perf_counter(), False
        save_state(self.run.accelerator, self.resume_dir,
                   {"step": state.step, "batches": state.batches, "log": state.log,
                    "seconds": time.perf_counter() - state.started, "l1_reference": state.l1_reference,
                    "l1_scale": state.l1_scale, "l1_eps": state.l1_eps,
                    "processes": self.run.world, "inputs": self.inputs, "before_training": self.before_training,
                    "run_name": self.run_name},
                   state.last_fired, self.run.config,
                   state.data_position)
        self.saved_step, state.settled = state.step, True
        if progress:
            progress.console.print(f"saved in {time.perf_counter() - saving:.1f} s")

    def after_step(self, state: RunState, stop: StopRequest) -> None:
        """At the end of each step (collective: every process calls it): saves and raises TrainingInterrupted
        when a process was asked to stop, saves when a periodic save is due, and saves the last step where
        periodic saves are on and an error after training could not save (saves_after_training)."""
        config, total = self.run.config, self.run.total
        # the main process's clock decides, so that every process saves at the same step
        due = bool(config.save_every_minutes) and time.perf_counter() - self.last_save >= 60 * config.save_every_minutes
        # a stop asked for in the last step stops too: a second Ctrl-C during the measuring and export that
        # follow would lose the run, where --resume from this state goes straight to them
        stopped_by, due = stop.agreed(due)
        if stopped_by:
            if self.resume_dir is None:
                raise KeyboardInterrupt
            self.save(state)
            raise TrainingInterrupted(f"interrupted at step {state.step} of {total}; the training state is in "
                                      f"{self.resume_dir}: run the same command with --resume to continue", stopped_by)
        periodic = due or config.save_every and state.step % config.save_every == 0
        periodic_on = bool(config.save_every or config.save_every_minutes)
        last = state.step == total and periodic_on and not self.saves_after_training
        if (periodic and state.step < total or last) and self.resume_dir is not None:
            self.save(state)
            self.last_save = time.perf_counter()

    def after_error(self, state: RunState) -> None:
        """An error in training (bad data, out of memory) saves the last completed step, in single-process runs
        only: the save is collective, and the other processes wait in a collective of the step that the failed
        one never reaches (or fail at other points), so they would never join it. There the last periodic save
        stands. Says where the state of the last completed step is, if it is saved."""
        if self.resume_dir is None or not state.settled:
            return
        if self.run.world == 1 and state.step > self.saved_step:
            self.save(state)
        self._say_saved(state)

    def after_training_error(self, state: RunState, seconds: float) -> None:
        """An error (or Ctrl-C) in a stage after training, `seconds` of it: saves the trained state where it
        can (saves_after_training), recording the training's time, not the stages' after it, with SIGINT and
        SIGTERM held off (a second Ctrl-C would cut the save short and lose the weights)."""
        if self.resume_dir is None:
            return
        if self.saves_after_training and state.step > self.saved_step:
            state.started = time.perf_counter() - seconds
            held = StopRequest(1)  # notes the signals instead of acting on them
            try:
                self.save(state)
            finally:
                held.close()
        self._say_saved(state)

    def _say_saved(self, state: RunState) -> None:
        if 0 < state.step == self.saved_step and self.run.accelerator.is_main_process:
            console.print(f"the training state of step {state.step} of {self.run.total} is saved in {self.resume_dir}: "
                          "run the same command with --resume to continue from it", soft_wrap=True)  # a path whole


class StopRequest:
    """SIGINT and SIGTERM during training, as a request to stop after the step in progress. The handlers only
    note the signal; at each step's end the processes agree (a two-int all-reduce over a CPU process group,
    no GPU sync), so that all of them stop after the same step even when the signal reaches them at
    different points of it, or reaches only some of them. Further signals while the state is saved are
    noted and ignored. Where both came, SIGTERM is the one the run stops by (the higher number)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, world: int):
        self.signum = 0  # the signal noted, 0: none
        self.group = torch.distributed.new_group(backend="gloo") if world > 1 else None
        # handlers can be set only from the main thread; elsewhere signals keep their own effect
        main = threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS} if main else {}

    def _note(self, signum, frame) -> None:
        self.signum = max(self.signum, signum)

    def agreed(self, save_due: bool = False) -> tuple[int, bool]:
        """(signal, save): the signal that asked any process to stop (0: none), and whether the main process
        finds a periodic save due (collective: every process calls it at each step)."""
        if self.group is None:
            return self.signum, save_due
        flags = torch.tensor([self.signum, int(save_due) if torch.distributed.get_rank() == 0 else 0])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flags[0]), bool(flags[1])

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
