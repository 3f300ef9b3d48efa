"""Library notices a user cannot act on, silenced where they arise; the rest said once, by rank 0.

megatron-core, DeepSpeed and torch each announce facts about the install that a scaletrain user
can do nothing about: two ranks under torchrun printed 24 such lines before their first step
(issue 21). Each is filtered by its exact text, so a notice that a later version adds still shows.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

# megatron-core 0.16, on import of its optimizer and FSDP modules: apex and TransformerEngine are
# optional accelerators (STYLE.md 9), the pure-PyTorch fallbacks are the tested path.
APEX_MISSING = "Transformer Engine and Apex are not installed"
# torch 2.13 deprecates the collectives that DeepSpeed's ZeRO and megatron's sequence parallelism
# call (torch/distributed/distributed_c10d.py); only those libraries can move off them.
DEPRECATED_COLLECTIVES = (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor|_all_gather_base|"
                          r"_reduce_scatter_base|all_reduce_coalesced|all_gather_coalesced)`")
# megatron-core tensor_parallel/layers.py: a CUDA stream setting, meaningless without a GPU.
CUDA_CONNECTIONS_ADVICE = r"When using .* it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS"
# DeepSpeed 0.19 accelerator/real_accelerator.py, when torch sees no GPU: the CPU is what we train on.
CPU_ACCELERATOR = "Setting accelerator to CPU"
# DeepSpeed 0.19 pipe/engine.py broadcasts the loss and tied weights inside the autograd graph; it
# reduces their gradients itself (tests/train/test_layouts.py: PP runs match the single-rank model).
BROADCAST_IN_BACKWARD = "c10d::broadcast_: an autograd kernel was not registered"
# DeepSpeed 0.19 comm/torch.py build_shm_op prints this on stdout each time its CPU op loads.
OP_BUILT = re.compile(r"DeepSpeed \S+ built successfully$")
# DeepSpeed 0.19 pipe/module.py and pipe/topology.py print the seed settings, the process grid and
# each stage's layers by their class names on stdout; the start line states the layout.
PIPELINE_LAYOUT = re.compile(r"SEED_LAYERS=|Using topology: |stage=\d+ layers=\d+$| +\d+: \w+$|  loss: ")


def quiet_library_notices(reporting_rank: bool) -> None:
    """Before megatron or DeepSpeed is imported: filter their known notices; on every rank but the
    reporting one, every library warning (the ranks run the same code, so rank 0 says it for all)."""
    warnings.filterwarnings("ignore", message=APEX_MISSING, category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)
    warnings.filterwarnings("ignore", message=BROADCAST_IN_BACKWARD, category=UserWarning)
    # DeepSpeed sets its logger's level when it is imported; a filter added before is kept.
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addFilter(_not_cpu_accelerator)
    if not reporting_rank:
        warnings.simplefilter("ignore")
        deepspeed_logger.addFilter(_errors_only)


def quiet_cpu_notices() -> None:
    """Advice that only applies to GPUs, filtered when torch sees none (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=CUDA_CONNECTIONS_ADVICE, category=UserWarning, module="megatron")


def _not_cpu_accelerator(record: logging.LogRecord) -> bool:
    return CPU_ACCELERATOR not in record.getMessage()


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def without_stdout_lines(dropped: re.Pattern[str]) -> Iterator[None]:
    """Around a library call that prints notices on stdout (OP_BUILT, PIPELINE_LAYOUT): the lines
    that `dropped` matches from their start are left out, the rest pass through."""
    filtered = _LineFilter(sys.stdout, dropped)
    try:
        with contextlib.redirect_stdout(filtered):
            yield
    finally:
        filtered.close_line()


class _LineFilter(io.TextIOBase):
    """A text stream that forwards whole lines to `target`, except those matching `dropped`."""

    def __init__(self, target: TextIO, dropped: re.Pattern[str]) -> None:
        super().__init__()
        self._target, self._dropped, self._partial = target, dropped, ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if not self._dropped.match(line):
                self._target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def close_line(self) -> None:
        """Forward an unfinished last line as it is."""
        if self._partial and not self._dropped.match(self._partial):
            self._target.write(self._partial)
        self._partial = ""
        self._target.flush()
