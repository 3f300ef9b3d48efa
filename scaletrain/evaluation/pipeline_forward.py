"""Scoring through pipeline stages: one batch forward through a TransformerPipeline's stages, outside DeepSpeed's
pipeline engine, for evaluation/scoring.py.

DeepSpeed's `PipelineEngine.eval_batch` runs a schedule of micro-batches of one shape, starts with a barrier of
the whole world and needs an engine; scoring sends batches of every length, the data-parallel replicas each score
their own share of the requests (as many batches as they have), and `scaletrain eval --tasks` has no engine. So
each stage runs its own layers (`TransformerPipeline.forward`, which packs what crosses a stage boundary into
tensors, model/pipeline.py) and sends the result to the next stage's rank of the same tensor-parallel rank and
replica: first a description of the tensors (dtype and shape each), then the tensors. The last stage scores the
logits and broadcasts the scores to its pipeline's other stages, so every rank of the replica returns them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from scaletrain.evaluation.scoring import ScoreForward, TokenScores, token_scores
from scaletrain.model.chunked_cross_entropy import as_logits


def pipeline_forward(pipeline: nn.Module) -> ScoreForward:
    """The scores of `pipeline` (this rank's stage of a model/pipeline.py TransformerPipeline) on a batch whose
    keys are the family's batch schema's first-stage inputs."""
    schema = pipeline.batch_schema
    first, last = pipeline.stage_id == 0, pipeline.stage_id == pipeline.num_stages - 1

    def forward(inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> TokenScores:
        if first:
            stage_input = tuple(inputs[key] for key in (*schema.inputs, *schema.optional_inputs) if key in inputs)
        else:
            stage_input = _receive(parallel_state.get_pipeline_model_parallel_prev_rank(), targets.device)
        outputs = pipeline(stage_input)
        if not last:
            _send(tuple(outputs), parallel_state.get_pipeline_model_parallel_next_rank())
            scores = None
        else:
            scores = token_scores(as_logits(outputs[0]).transpose(0, 1), targets)
        return _from_last_stage(scores, targets)

    return forward


def _send(tensors: tuple[torch.Tensor, ...], destination: int) -> None:
    dist.send_object_list([[(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]], dst=destination,
                          device=tensors[0].device)
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=destination)


def _receive(source: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    described: list = [None]
    dist.recv_object_list(described, src=source, device=device)
    tensors = tuple(torch.empty(shape, dtype=dtype, device=device) for dtype, shape in described[0])
    for tensor in tensors:
        dist.recv(tensor, src=source)
    return tensors


def _from_last_stage(scores: TokenScores | None, targets: torch.Tensor) -> TokenScores:
    """The last stage's scores [batch, length] on every stage of its pipeline."""
    message = (torch.stack([scores.log_probs, scores.greedy.float()]) if scores is not None
               else torch.empty(2, *targets.shape, dtype=torch.float32, device=targets.device))
    dist.broadcast(message, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return TokenScores(message[0], message[1].bool())
