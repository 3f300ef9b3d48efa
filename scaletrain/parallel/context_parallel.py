"""Context parallelism: each sequence split over the context-parallel ranks, attention by ring attention.

Which tokens a rank holds: the sequence is cut into 2·CP equal chunks and rank r holds chunks r and
2·CP-1-r ("zigzag", Megatron-LM / TransformerEngine's load balancing for causal attention), so every rank
has as many early tokens, which see few keys, as late ones, which see many. Every per-token layer (norms,
MLP, logits, loss) runs on those tokens alone; positions are their global positions.

Attention is exact ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", sec. 3): each rank keeps its queries and passes its keys and values around the
context-parallel ring; at each of the CP steps it attends its queries to the block it holds, masked by
global positions, and merges the block's (output, logsumexp) into the running result with the online
softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"):

    lse = logaddexp(lse_a, lse_b);   out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)

so no rank ever holds more than one other rank's keys. The shift is an autograd Function whose backward
sends the keys' and values' gradient the other way round the ring, so autograd's gradients are exact.

Masked scores are a large finite negative number, not -inf: a query that sees none of a block's keys then
gets a finite log-sum-exp that weighs exp(-1e30) = 0 in the merge, and no NaN reaches the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

# visible(query_positions [q], key_positions [k]) -> bool mask broadcastable to [batch, heads, q, k]
Visibility = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MASKED_SCORE = -1e30


@dataclass(frozen=True)
class RingMask:
    """What one attention layer's ring needs: this rank's global positions [n] and which keys a query sees."""

    positions: torch.Tensor
    visible: Visibility


def context_parallel_size() -> int:
    """Ranks each sequence is split over; 1 when no process groups are set up (one process)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def zigzag_positions(seq_length: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """[seq_length / size] int64: the global positions of rank `rank`'s tokens, chunks r and 2·size-1-r."""
    chunk = seq_length // (2 * size)
    last = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange(last * chunk, (last + 1) * chunk, device=device)])


def local_positions(seq_length: int, device: torch.device) -> torch.Tensor:
    """This rank's global positions under context parallelism (all of them without it)."""
    size = context_parallel_size()
    if size == 1:
        return torch.arange(seq_length, device=device)
    return zigzag_positions(seq_length, size, parallel_state.get_context_parallel_rank(), device)


def local_tokens(sequence: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's slice of a full-sequence tensor (tokens, labels, document ids) along `dim`."""
    if context_parallel_size() == 1:
        return sequence
    return sequence.index_select(dim, local_positions(sequence.shape[dim], sequence.device))


def context_parallel_token_mean(token_sum: torch.Tensor, token_count: torch.Tensor) -> torch.Tensor:
    """This rank's share of the mean over its replica's tokens, scaled by CP: local sum · CP / the CP
    group's count. DeepSpeed averages gradients (and train_step the loss) over the data x context ranks,
    so the average of these shares is the mean over all of a replica's tokens, as on one rank."""
    size = context_parallel_size()
    if size == 1:
        return token_sum / token_count.clamp(min=1)
    count = token_count.detach().clone()
    dist.all_reduce(count, group=parallel_state.get_context_parallel_group())
    return token_sum * size / count.clamp(min=1)


class _RingShift(torch.autograd.Function):
    """Forward: send this block to the next rank of the ring, receive the previous rank's.
    Backward: the gradient goes the other way (to the previous rank, from the next)."""

    @staticmethod
    def forward(ctx, block: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (autograd's ctx)
        return _exchange(block, step=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return _exchange(grad, step=-1)


def _exchange(tensor: torch.Tensor, step: int) -> torch.Tensor:
    """Send `tensor` to the ring neighbour `step` ahead and return what the one `step` behind sent."""
    ranks = parallel_state.get_context_parallel_global_ranks()
    rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    operations = [dist.P2POp(dist.isend, tensor, ranks[(rank + step) % len(ranks)], group),
                  dist.P2POp(dist.irecv, received, ranks[(rank - step) % len(ranks)], group)]
    for request in dist.batch_isend_irecv(operations):
        request.wait()
    return received


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, visible: Visibility,
    scale: float | None = None, dropout: float = 0.0,
) -> torch.Tensor:
    """Exact attention of this rank's queries to the whole sequence's keys.

    query [batch, heads, n, head_dim], key/value [batch, kv_heads, n, head_dim] (grouped-query: heads a
    multiple of kv_heads): this rank's n tokens, at global `positions` [n] (zigzag_positions). Returns
    the attention output [batch, heads, n, head_dim] in query's dtype. Each step attends each of this
    rank's two chunks to each chunk of the block held, skipping chunk pairs `visible` masks entirely.
    """
    size, rank = context_parallel_size(), parallel_state.get_context_parallel_rank()
    seq_length, half = positions.shape[0] * size, positions.shape[0] // 2
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    merged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]  # per query chunk: (out, lse)
    block = torch.stack([key, value])
    for step in range(size):
        if step:
            block = _RingShift.apply(block)
        key_positions = zigzag_positions(seq_length, size, (rank - step) % size, positions.device)
        pairs = []
        for q_chunk in range(2):
            for k_chunk in range(2):
                mask = visible(positions[q_chunk * half:(q_chunk + 1) * half],
                               key_positions[k_chunk * half:(k_chunk + 1) * half])
                if mask.any() or (not pairs and q_chunk == k_chunk == 1):
                    # a block no query sees is still attended once (with weight exp(-1e30) = 0), so every
                    # rank's backward passes the same gradients round the ring
                    pairs.append((q_chunk, k_chunk, None if mask.all() else mask))
        for q_chunk, k_chunk, mask in pairs:
            keys = block[:, :, :, k_chunk * half:(k_chunk + 1) * half]
            out, lse = _attend(query[:, :, q_chunk * half:(q_chunk + 1) * half], keys[0], keys[1], mask, scale,
                               dropout)
            merged[q_chunk] = _merge(merged[q_chunk], out, lse)
    return torch.cat([merged[0][0], merged[1][0]], dim=2).to(query.dtype)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's softmax attention in fp32: (output [b, h, q, d], logsumexp [b, h, q]). Dropout on
    the block's probabilities is dropout on the whole row's: the merge rescales a row by one factor."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, MASKED_SCORE)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse[..., None])
    if dropout:
        probabilities = F.dropout(probabilities, dropout)
    return torch.matmul(probabilities.to(value.dtype), value).float(), lse


def _merge(
    merged: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of a block's (out, lse) into the running (out, lse)."""
    if merged is None:
        return out, lse
    merged_out, merged_lse = merged
    total = torch.logaddexp(merged_lse, lse)
    return (merged_out * torch.exp(merged_lse - total)[..., None] + out * torch.exp(lse - total)[..., None], total)
