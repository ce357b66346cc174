"""Continued training of a relufied model, `train`: the loss is the cross-entropy (with `distill`, its mix with
KL(source || model); with `distill_hidden`, the distance to the source's hidden states) plus the L1 penalty on
the MLP hidden activations (loss.py); each MLP trains on the dense path or on the TwELL hybrid kernels as its
measured activity decides (routing.py). Runs under accelerate (one process, DDP, or FSDP2: loop.py, fsdp.py),
logs each log step's figures (log.py, trackers.py) and saves its state for --resume (sparsify.resume) on Ctrl-C
or SIGTERM, on a schedule, and on an error (saving.py). docs/design.md ("Data and training") describes the
whole."""
from ..config import HYBRID_EXIT, TrainConfig
from .fsdp import fsdp_launch, gather_model
from .loop import train
from .loss import LossTerms, l1_coeff, source_share
from .memory import (TRAINING_BYTES, check_training_memory, cpu_training_warning, on_cpu, slow_save_warning,
                     training_state_bytes)
from .routing import hybrid_kernels_run, hybrid_paths, hybrid_share
from .state import TrainingInterrupted, TrainResult
from .trackers import trackers

__all__ = ["HYBRID_EXIT", "LossTerms", "TRAINING_BYTES", "TrainConfig", "TrainResult", "TrainingInterrupted",
           "check_training_memory", "cpu_training_warning", "fsdp_launch", "gather_model", "hybrid_kernels_run",
           "hybrid_paths", "hybrid_share", "l1_coeff", "on_cpu", "slow_save_warning", "source_share", "train",
           "trackers", "training_state_bytes"]
