"""The plan's predicted wall time of a run: its optimizer steps, its evaluations and its startup.

The spec's throughput model (spec.py ThroughputModel) prices a step at step_overhead_s plus its FLOPs at
flops_per_s. An evaluation is a forward pass over the validation sequences it reads (train.eval_samples,
or the whole split with `all`) in micro-batches of train.micro_batch_size (train/evaluation.py): priced
here as one step overhead per micro-batch plus a third of a training step's FLOPs per token (the forward
of forward + backward, Kaplan et al. 2020, sec. 2.1). With the whole split that is no small cost: the
English corpus's 6,819 validation sequences of 128 tokens take 1,705 forwards of 4 sequences, longer
than a small model's cooldown branch of a thousand steps. The loop evaluates at step 0 of a run that
starts there, every train.eval_every steps, and at the last step (train/hooks/evaluation.py);
`evaluations` counts the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.config import EVAL_ALL, Config
from scaletrain.data.storage import dataset_location
from scaletrain.model.counts import ModelCounts
from scaletrain.scaling.sweep.spec import ThroughputModel

FORWARD_SHARE = 1 / 3  # of a training step's FLOPs per token: the forward pass of forward + backward


@dataclass(frozen=True)
class RunTime:
    """Seconds per optimizer step, per evaluation, and for starting the process."""

    step_s: float
    evaluation_s: float
    startup_s: float

    def predicted_s(self, start: int, end: int, eval_every: int) -> float:
        """A run (or a ladder's branch) trained from step `start` to `end`, evaluating every `eval_every`."""
        return self.startup_s + (end - start) * self.step_s + evaluations(start, end, eval_every) * self.evaluation_s


def evaluations(start: int, end: int, eval_every: int) -> int:
    """How often the loop evaluates a run trained from `start` to `end`: at step 0 when it starts there, at
    every multiple of eval_every after `start`, and at `end` (0: never)."""
    if eval_every < 1:
        return 0
    return int(start == 0) + end // eval_every - start // eval_every + int(end % eval_every != 0)


def run_time(throughput: ThroughputModel, base: Config, counts: ModelCounts, tokens_per_step: int,
             validation_sequences: int | None) -> RunTime:
    """The throughput model's prices for one run (validation_sequences: those of the split, None unknown)."""
    step_s = throughput.step_overhead_s + tokens_per_step * counts.flops_per_token / throughput.flops_per_s
    read = evaluated_sequences(base, validation_sequences)
    micro_batch = base.train.micro_batch_size
    # the sequences past the last whole micro-batch take one forward each (data/sampler.py)
    forwards = read // micro_batch + read % micro_batch
    forward_s = micro_batch * base.model.seq_length * counts.flops_per_token * FORWARD_SHARE / throughput.flops_per_s
    return RunTime(step_s, forwards * (throughput.step_overhead_s + forward_s), throughput.startup_s)


def evaluated_sequences(base: Config, validation_sequences: int | None) -> int:
    """train.eval_samples, at most the split's; the whole split with `all` (0 while it is not prepared)."""
    samples = base.train.eval_samples
    if samples == EVAL_ALL:
        return validation_sequences or 0
    return int(samples) if validation_sequences is None else min(int(samples), validation_sequences)


def validation_sequences(base: Config) -> int | None:
    """The validation split's sequences of model.seq_length tokens over the blend's datasets (its tokens /
    seq_length, rounded up: the last is padded), None where one is not prepared."""
    locations = [dataset_location(base.data, source.dir) for source in base.data.sources()]
    if not all(location.is_prepared() for location in locations):
        return None
    splits = [location.load_manifest().splits for location in locations]
    return sum(math.ceil(split["val"].num_tokens / base.model.seq_length) for split in splits if "val" in split)
