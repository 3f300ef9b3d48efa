"""The batch schema shared by collators, models, the training step and the pipeline.

A batch is a dict of [batch, seq] (or [batch]) tensors. Its keys are the model's forward
arguments; which of them are inputs and which are labels is the family's `BatchSchema`, so the
training step and the pipeline never spell a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # labels to skip: torch.nn.functional.cross_entropy's default ignore_index
GLOBAL_INDEX = "global_index"  # the loader's bookkeeping, not a model input
DOCUMENT_IDS = "document_ids"  # [batch, seq]: which packed document each token is in (data/objectives.py)

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class BatchSchema:
    """Which batch keys feed the first pipeline stage (`inputs`, in the order the first layer takes
    them) and which the loss reads on the last (`labels`). `optional` keys may be absent; when
    present they follow their group."""

    inputs: tuple[str, ...]
    labels: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    optional_labels: tuple[str, ...] = ()

    def model_inputs(self, batch: Batch) -> Batch:
        """The keyword arguments of the model's forward: inputs and labels."""
        keys = (*self.inputs, *self.optional_inputs, *self.labels, *self.optional_labels)
        return {key: batch[key] for key in keys if key in batch}

    def split(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(first-stage inputs, last-stage labels), as DeepSpeed's pipeline engine wants them."""
        inputs = tuple(batch[key] for key in (*self.inputs, *self.optional_inputs) if key in batch)
        labels = tuple(batch[key] for key in (*self.labels, *self.optional_labels) if key in batch)
        return inputs, labels
