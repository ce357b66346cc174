"""What training takes in memory before any activation (training_state_bytes), checked against the GPUs before
any weight is read, and the warning for a state too large to save within a launcher's shutdown timeout."""
from __future__ import annotations

import torch

from ..config import LAUNCHER_GRACE_S
from ..errors import ConfigError

TRAINING_BYTES = 16  # a parameter's fp32 weight and gradient and its two fp32 AdamW moments
TEACHER_BYTES = 2  # a parameter of the distillation teacher (bf16)


def training_state_bytes(parameters: int, processes: int, sharded: bool, teacher: bool = False) -> float:
    """Bytes of training state on each process before any activation: the whole state, or under FSDP
    (`sharded`) its share, and a distillation `teacher` whole on each."""
    return TRAINING_BYTES * parameters / (processes if sharded else 1) + (TEACHER_BYTES * parameters if teacher else 0)


def check_training_memory(parameters: int, device: str | None, processes: int, sharded: bool,
                          teacher: bool = False) -> None:
    """ConfigError when the training state alone (TRAINING_BYTES a parameter, before any activation; with a
    distillation `teacher` TEACHER_BYTES more) exceeds the GPU's memory: the whole state on each GPU, or
    under FSDP (`sharded`) its share. Nothing on CPU."""
    if on_cpu(device):
        return
    index = torch.device(device).index if device else None
    total = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).total_memory
    need = training_state_bytes(parameters, processes, sharded, teacher)
    if need > total:
        fix = (f"use more than {processes} GPUs" if sharded else
               "shard it over several GPUs: accelerate launch --config_file recipes/accelerate/fsdp.yaml "
               "--num_processes N -m cli convert ...")
        raise ConfigError(f"training {parameters / 1e9:.2f}B parameters needs {need / 2**30:.0f} GiB on each GPU "
                          "for the weights, gradients and AdamW state"
                          f"{' and the distillation teacher' if teacher else ''} alone, "
                          f"and this GPU has {total / 2**30:.0f} GiB: {fix}")


# The arithmetic of the demo's conversion (recipes/demo.yaml: 819,200 tokens on its 3.05M parameters), which takes
# minutes on a 2-core CPU (docs/performance.md, "The demo conversion (CPU)"); parameters x tokens a run does
DEMO_WORK = 3.05e6 * 819_200


def cpu_training_warning(parameters: int, tokens: int, device: str | None, teacher: bool = False,
                         calibration: int = 0) -> str | None:
    """The warning for a training run on the CPU of more than ten times the demo conversion's arithmetic (None
    otherwise): parameters x tokens, a third more with a distillation `teacher` (its forward pass beside the
    model's forward and backward), and `calibration`, what sparse calibration adds (its MLPs' parameters x the
    rows of all its steps: a forward and backward of each MLP on them)."""
    work = parameters * tokens * (4 / 3 if teacher else 1) + calibration
    if not on_cpu(device) or work <= 10 * DEMO_WORK:
        return None
    times = work / DEMO_WORK
    extra = " and ".join(what for what, on in (("a distillation teacher", teacher), ("sparse calibration", calibration))
                         if on)
    return (f"training {parameters / 1e6:,.0f}M parameters on {tokens:,} tokens{f' with {extra}' if extra else ''} on "
            f"the CPU: {times:,.0f} times the arithmetic of the demo's conversion, so about {times:,.0f} times its "
            "minutes on the same CPU. A CUDA GPU is what sparsify trains on (and where the sparse kernels run)")


# A sharded training state above this size takes longer to write than a launcher waits after a Ctrl-C
# (docs/performance.md, "Training under FSDP")
SLOW_SAVE_GIB = 30


def slow_save_warning(parameters: int, processes: int, save_every: float) -> str | None:
    """The warning for a multi-process run whose training state is too large to save within a launcher's
    shutdown timeout, with no periodic save (`save_every`: steps or minutes, 0 for none) to fall back on
    (None otherwise)."""
    gib = TRAINING_BYTES * parameters / 2**30
    if processes < 2 or save_every or gib <= SLOW_SAVE_GIB:
        return None
    return (f"the training state is {gib:.0f} GiB: after a Ctrl-C, `accelerate launch` and torchrun kill the "
            f"processes within {LAUNCHER_GRACE_S} s, before a state this size is written, and the run could not "
            "be resumed; pass --save-every N or --save-every-minutes M to also "
            "save it periodically")


def on_cpu(device: str | None) -> bool:
    """Whether training runs on CPU. accelerate must be told (`cpu=True`) even without a GPU, else
    processes started by torchrun do not join one CPU (gloo) process group."""
    return device == "cpu" or not torch.cuda.is_available()
