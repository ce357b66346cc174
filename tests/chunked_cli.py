"""`python tests/chunked_cli.py ARGS` = `sparsify ARGS` with the LM head and loss in chunks of 5 tokens
(helpers.SMALL_CHUNK_BYTES: a test's micro-batch would otherwise fit in one chunk and take the whole logits), for
tests that start processes of their own (torchrun's, accelerate's). At exit each process prints how many
micro-batches took the chunks (after helpers.CHUNKED_CALLS), which those tests read with helpers.chunked_calls.
SPARSIFY_TEST_SIGNAL=RANK:N:NAME sends the signal NAME (SIGINT: Ctrl-C, SIGTERM: a job scheduler's stop) to the
process of that rank alone when it reads its N-th training batch (0-based; the stream itself unchanged), or, with N
`measure`, as it starts measuring the trained model.
"""
import atexit
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's cli.py, not tests/
from cli import main  # noqa: E402

from helpers import CHUNKED_CALLS, SMALL_CHUNK_BYTES, on_read  # noqa: E402  (tests/, this script's folder)
from sparsify import convert  # noqa: E402
from sparsify.data import TrainingBatches  # noqa: E402
from sparsify.train import head_loss  # noqa: E402
from twell.training import head_loss as head_loss_op  # noqa: E402

calls = []
head_losses = head_loss.head_losses


def counted_head_losses(*args):
    calls.append(1)
    return head_losses(*args)


head_loss_op.CHUNK_BYTES = SMALL_CHUNK_BYTES
head_loss.head_losses = counted_head_losses
atexit.register(lambda: print(CHUNKED_CALLS, len(calls), flush=True))
if "SPARSIFY_TEST_SIGNAL" in os.environ:
    rank, at, name = os.environ["SPARSIFY_TEST_SIGNAL"].split(":")
    if os.environ.get("RANK", "0") == rank:  # the launchers (torchrun, accelerate's) set each process's RANK
        def send():
            os.kill(os.getpid(), getattr(signal, name))

        if at == "measure":
            measure = convert.measure

            def signalled_measure(*args, **kwargs):
                send()
                return measure(*args, **kwargs)

            convert.measure = signalled_measure
        else:
            TrainingBatches.__next__ = on_read(TrainingBatches.__next__, int(at), send)

if __name__ == "__main__":
    main()
