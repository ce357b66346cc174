"""`python tests/fsdp_on_cpu.py ARGS` = `sparsify ARGS` with accelerate's FSDP on CPU processes (gloo), for tests.

accelerate (1.15) takes the FSDP branch only for GPU-like distributed types: AcceleratorState.__init__
(accelerate/state.py, `elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`) leaves CPU
processes at MULTI_CPU, i.e. DDP, whatever ACCELERATE_USE_FSDP says, and `accelerate launch --cpu` refuses
`--use_fsdp`. This sets the FSDP type and plugin on CPU as that branch does on GPUs; everything after it is
accelerate's own FSDP2 code (fully_shard in prepare, no_sync, clip_grad_norm_, save_state and load_state,
get_state_dict) on torch's gloo backend. Start it with `accelerate launch --config_file
recipes/accelerate/fsdp.yaml --num_processes 2 tests/fsdp_on_cpu.py convert ...`.

Checks ride along: every ReluGatedMLP forward asserts that the weights the hybrid kernels would take are
whole plain tensors (FSDP has unsharded its layer), and the chunked LM head (train.head_loss, in chunks of 5 tokens
as tests/chunked_cli.py sets them, which also prints each process's count of chunked calls) that it computes on the
whole head weight (its forward runs inside its FSDP unit's call); only the main process reads the source
weights (the config's fsdp_cpu_ram_efficient_loading: the others get theirs from it in accelerate's preparation);
chunked_cli.py's SPARSIFY_TEST_SIGNAL signals one process during training; and SPARSIFY_TEST_FAIL_WRITE makes the
main process's export fail after training.
"""
import functools
import os

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from chunked_cli import main  # tests/, this script's folder: the repository's cli, chunks of 5 tokens, counted
from helpers import VOCAB_SIZE
from sparsify import convert
from sparsify.relufy import ReluGatedMLP
from sparsify.train import head_loss

init = AcceleratorState.__init__


@functools.wraps(init)
def fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        assert os.environ.get("ACCELERATE_USE_FSDP") == "true"
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as the end of __init__ does


forward = ReluGatedMLP.forward


def forward_on_whole_weights(self, x):
    gate, up, down = self.weights()
    assert not any(isinstance(w, DTensor) for w in (gate, up, down)), "the MLP got DTensor shards, not whole weights"
    assert gate.shape == up.shape == down.T.shape == (down.shape[1], x.shape[-1]), "the MLP got a part of its weights"
    return forward(self, x)


head_losses = head_loss.head_losses


def head_losses_on_whole_weight(hidden, weight, *args):
    assert not isinstance(weight, DTensor) and weight.shape == (VOCAB_SIZE, hidden.shape[-1]), \
        "the chunked LM head got a shard of its weight"
    return head_losses(hidden, weight, *args)


load_model = convert.load_model


def fail_to_write(*args, **kwargs):
    raise OSError(28, "No space left on device")


def load_on_main_only(*args, weights=True, **kwargs):
    assert weights == PartialState().is_main_process, "only the main process reads the source weights"
    return load_model(*args, weights=weights, **kwargs)


AcceleratorState.__init__ = fsdp_on_cpu
ReluGatedMLP.forward = forward_on_whole_weights
head_loss.head_losses = head_losses_on_whole_weight
convert.load_model = load_on_main_only
if "SPARSIFY_TEST_FAIL_WRITE" in os.environ:  # the main process's export fails after training
    convert._write = fail_to_write

if __name__ == "__main__":
    main()
