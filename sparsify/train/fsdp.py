"""FSDP2 launches: whether `accelerate launch` started this process with an FSDP config, that it runs as FSDP2,
and the whole trained model gathered from its shards."""
from __future__ import annotations

import copy
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from .. import relufy
from ..errors import ConfigError
from ..families import spec_for


def fsdp_launch() -> tuple[bool, bool]:
    """(FSDP, rank-0 loading): whether `accelerate launch` started this process with an FSDP config
    (check_fsdp makes sure it runs as FSDP2), and whether that config has fsdp_cpu_ram_efficient_loading
    (accelerate's preparation then broadcasts the main process's weights, so the others need not read them)."""
    def flag(name):
        return os.environ.get(name, "false").lower() == "true"

    fsdp = flag("ACCELERATE_USE_FSDP")
    return fsdp, fsdp and flag("FSDP_CPU_RAM_EFFICIENT_LOADING")


def check_fsdp(accelerator: Accelerator) -> None:
    """An FSDP config that accelerate would not run as FSDP2 is an error, not a silent fallback."""
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError("FSDP: sparsify trains with FSDP2 only; set fsdp_version: 2 in the accelerate config "
                          "(as recipes/accelerate/fsdp.yaml does)")
    if fsdp_launch()[0] and not accelerator.is_fsdp2:
        raise ConfigError(f"FSDP runs on GPUs only: accelerate runs these {accelerator.device.type} processes as "
                          f"{accelerator.distributed_type.value} "
                          "(use `accelerate launch` without the FSDP config, or GPUs)")


def gather_model(model, mlps: list):
    """The whole model from one that FSDP shards over the processes (a collective: every process calls it):
    an unsharded model of the same family, relufied, on the main process's CPU (full weights gathered shard
    by shard into CPU memory, never onto one GPU); None on the other processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: b.detach().cpu() for name, b in model.named_buffers()}  # not sharded (rotary tables)
    if torch.distributed.get_rank() != 0:
        return None
    spec = spec_for(model.config)
    config = copy.deepcopy(model.config)
    setattr(config, spec.act_key, mlps[0].original_act)  # relufy below records it and sets "relu"
    with torch.device("meta"):
        full = spec.causal_lm_class()(config)
    relufy.relufy(full)
    full.load_state_dict(state, assign=True)
    for name, buffer in buffers.items():  # non-persistent buffers are in no state dict
        owner, _, attr = name.rpartition(".")
        setattr(full.get_submodule(owner), attr, buffer)
    full.tie_weights()
    full.generation_config = model.generation_config
    return full.eval()
