"""The output layer and its vocab-parallel cross-entropy a chunk of tokens at a time (`train.loss_chunk_size`).

The plain loss makes the logits of every position of the micro-batch, [s·b, V/t], casts them to fp32 and
keeps the softmax for backward: at s·b = 16k tokens and V = 50k that is 3.3 GB, the largest activation of
a small model. Here the output projection and the cross-entropy run over N tokens at a time and backward
projects each chunk again, so no more than one chunk's logits exist at any time, in forward or backward.
This is the idea of Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024) and of Cut Cross-Entropy
(Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models", sec. 4), in plain PyTorch:

    forward   per chunk: logits = h·Wᵀ in fp32; lse = log Σ exp(logits) and the target's logit, both over
              the whole vocabulary (all-reduced over the TP ranks' vocabulary shards, as megatron's
              vocab_parallel_cross_entropy does); loss = lse - logit[target]. Kept: h, W, the targets, lse.
    backward  per chunk: logits again, softmax = exp(logits - lse), minus one at the target, times the
              loss gradient: dh = g·W, dW += gᵀ·h. The saved lse makes the softmax exact with no
              communication; the TP sum of dh is the output layer's own (megatron's copy / SP gather).

Why an autograd Function and not torch.utils.checkpoint around each chunk: checkpoint would keep as little,
but its backward reruns the forward, megatron's three all-reduces over the TP group included, per chunk.
Why backward recomputes the logits (one more h·Wᵀ per chunk, CCE's choice) rather than computing the
gradients in forward (Liger's): those would be kept from forward to backward, dW in fp32 ([V/t, h]: 2.1 GB
for Llama-3 8B at t=1) beside dh, and computed in evaluation forwards too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel

from scaletrain.config import Config, ConfigError


@dataclass(frozen=True)
class DeferredLogits:
    """What an output layer gives in place of its logits [seq, batch, vocab/t] when the loss is chunked:
    its input and weight, so the loss can project a chunk of tokens at a time. Ask `as_logits` for the
    logits themselves (inference)."""

    hidden: torch.Tensor  # [seq, batch, h]: the whole sequence on every TP rank (after the copy / SP gather)
    weight: torch.Tensor  # [vocab/t, h]: this rank's vocabulary rows
    chunk_size: int  # tokens (of the seq·batch positions) per chunk


def defer_lm_logits(
    hidden: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool, chunk_size: int
) -> DeferredLogits:
    """The vocab-parallel output layer's input as its logits would see it: copied into the TP region (its
    gradient all-reduced over TP ranks in backward), or under sequence parallelism gathered along the
    sequence (its gradient reduce-scattered), as megatron's ColumnParallelLinear does for the logits.
    Under SP the gathered [s, b, h] is kept for backward, where megatron keeps the 1/t shard: s·b·h more,
    against the s·b·V/t of logits not kept."""
    if sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    return DeferredLogits(hidden, weight, chunk_size)


def as_logits(output: torch.Tensor | DeferredLogits) -> torch.Tensor:
    """Vocab-parallel logits [seq, batch, vocab/t] from what the output layer gave."""
    if isinstance(output, DeferredLogits):
        return F.linear(output.hidden, output.weight)
    return output


def chunked_vocab_parallel_cross_entropy(output: DeferredLogits, targets: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 cross-entropy [seq, batch] against targets [seq, batch] (vocabulary ids, each >= 0),
    as megatron's vocab_parallel_cross_entropy(logits.float(), targets) gives, a chunk at a time."""
    hidden = output.hidden.reshape(-1, output.hidden.shape[-1])
    losses = _ChunkedVocabParallelCrossEntropy.apply(hidden, output.weight, targets.reshape(-1), output.chunk_size)
    return losses.view_as(targets)


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """hidden [T, h], weight [V/t, h], targets [T] -> losses [T] (fp32); the module docstring has the math."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_size: int) -> torch.Tensor:
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        log_normalizers = torch.empty_like(losses)
        local_targets = targets - _vocab_start(weight)
        for rows in _chunks(hidden.shape[0], chunk_size):
            logits = F.linear(hidden[rows], weight).float()
            losses[rows], log_normalizers[rows] = _losses_and_log_normalizers(logits, local_targets[rows])
        ctx.save_for_backward(hidden, weight, local_targets, log_normalizers)
        ctx.chunk_size = chunk_size
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, local_targets, log_normalizers = ctx.saved_tensors
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        # summed over chunks in fp32, as one GEMM over all tokens would accumulate it
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        for rows in _chunks(hidden.shape[0], ctx.chunk_size):
            logits = F.linear(hidden[rows], weight).float()
            grad_logits = torch.exp_(logits.sub_(log_normalizers[rows, None]))  # the softmax, in place
            targets, owned = _owned_targets(local_targets[rows], weight.shape[0])
            grad_logits.scatter_add_(1, targets[:, None], -owned[:, None].float())  # minus one at an owned target
            grad_logits = grad_logits.mul_(grad_losses[rows, None]).to(hidden.dtype)
            if wants_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if wants_weight:
                grad_weight += torch.mm(grad_logits.t(), hidden[rows]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def _losses_and_log_normalizers(logits: torch.Tensor, local_targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(loss, log Σ exp over the whole vocabulary) per token of a chunk's fp32 logits [N, V/t] (overwritten).
    megatron's arithmetic: loss = log Σ exp(logits - max) - (logit[target] - max), max and the two sums
    all-reduced over TP (the two sums in one call)."""
    maximum = logits.max(dim=-1).values
    _all_reduce(maximum, dist.ReduceOp.MAX)
    logits.sub_(maximum[:, None])
    targets, owned = _owned_targets(local_targets, logits.shape[-1])
    target_logits = torch.where(owned, logits.gather(-1, targets[:, None]).squeeze(-1), 0.0)
    sums = torch.stack([logits.exp_().sum(dim=-1), target_logits])
    _all_reduce(sums, dist.ReduceOp.SUM)
    log_sum = sums[0].log()
    return log_sum - sums[1], log_sum + maximum


def _owned_targets(local_targets: torch.Tensor, vocab_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets as column indices of this rank's shard, clamped into it; whether this rank holds each)."""
    owned = (local_targets >= 0) & (local_targets < vocab_per_rank)
    return local_targets.clamp(0, vocab_per_rank - 1), owned


def _vocab_start(weight: torch.Tensor) -> int:
    """The first vocabulary id of this rank's rows (megatron's VocabUtility: equal contiguous shards)."""
    return parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> None:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())


def _chunks(tokens: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, tokens)) for start in range(0, tokens, chunk_size)]


def refuse_loss_chunking(config: Config, reason: str) -> None:
    """For a family whose loss does not take DeferredLogits: train.loss_chunk_size > 0 is an error there."""
    chunk_size = config.train.loss_chunk_size
    if chunk_size:
        raise ConfigError(f"train.loss_chunk_size={chunk_size} is not available for {config.model.family}: "
                          f"{reason}; set train.loss_chunk_size=0 (the chunked loss serves gpt and llama)")
