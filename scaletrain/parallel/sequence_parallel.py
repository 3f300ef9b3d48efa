"""Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) with megatron-core's own layers, on CPU too.

Under SP the parts of a block that tensor parallelism leaves replicated (LayerNorms, dropout,
residual adds) work on a 1/t slice of the sequence (dim 0 of [seq, batch, hidden]). megatron-core
does the switching itself once `ModelParallelConfig(sequence_parallel=True)`:
ColumnParallelLinear all-gathers its sequence-sharded input (g in the paper) and RowParallelLinear
reduce-scatters its output (g-bar) instead of all-reducing it. A model around those layers needs:

1. `scatter_to_sequence_parallel(embeddings)` after the embedding, and
   `sequence_parallel_lm_logits(hidden, word_embeddings)` for the tied output layer;
2. `mark_sequence_parallel(module)` on every block and the final norm, then
   `register_sequence_parallel_grad_hooks(model)` once, before wrapping it in DeepSpeed;
3. `enable_cpu_sequence_parallel()` once per process on a machine without CUDA.

Dropout inside the SP region must draw a different mask on each TP rank, since each rank holds
different tokens: megatron draws it under `get_cuda_rng_tracker().fork()` (a per-TP-rank seed).
That tracker is CUDA-only and nothing here replaces it, so run SP with dropout 0 on CPU; with
dropout > 0 and equally seeded CPU generators the TP ranks would reuse one mask pattern.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch import nn
from torch.utils.hooks import RemovableHandle

from scaletrain import upstream
from scaletrain.parallel.sharding import is_tensor_parallel


def enable_cpu_sequence_parallel() -> None:
    """Let megatron's own sequence-parallel code run on CPU tensors under gloo. Idempotent.

    megatron's SP collectives are `dist.all_gather_into_tensor` and `dist.reduce_scatter_tensor`
    (mappings.py, layers.py), which gloo implements in torch 2.13, so they stay as they are. What
    fails on CPU is only where their buffers live: megatron allocates them on
    `torch.cuda.current_device()`, which raises without CUDA; `upstream.allocate_megatron_buffers_on_cpu`
    makes them on the CPU, and every line of megatron's forward and backward runs unchanged.
    Nothing happens on a machine with CUDA.
    """
    if not torch.cuda.is_available():
        upstream.allocate_megatron_buffers_on_cpu()


def scatter_to_sequence_parallel(embeddings: torch.Tensor) -> torch.Tensor:
    """This rank's 1/t of the embedding output [seq, batch, hidden] along the sequence.

    As megatron's LanguageModelEmbedding: the embedding is computed whole (all-reduced over the
    vocabulary shards) and then split; backward all-gathers the sequence shards of the gradient, so
    position embeddings before the split get their full gradient on every rank. The split is a view
    of the whole output, so it is cloned, as megatron does (`clone_scatter_output_in_embedding`):
    otherwise the first LayerNorm saves that view and keeps all s*b*h alive until backward.
    """
    return tensor_parallel.scatter_to_sequence_parallel_region(embeddings).clone()


def sequence_parallel_lm_logits(hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
    """Logits [seq, batch, vocab/t] of this rank's vocabulary shard from the sequence-sharded final hidden.

    Megatron's GPTModel output layer: a ColumnParallelLinear under SP, i.e.
    `linear_with_grad_accumulation_and_async_allreduce(sequence_parallel=True)`. It all-gathers the
    hidden along the sequence in forward and reduce-scatters its gradient in backward (the gradient
    from each vocabulary shard is a partial sum, as `gather_from_sequence_parallel_region` with
    tensor_parallel_output_grad=True does), and it saves only the sequence shard for backward.
    """
    return tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        hidden, word_embeddings, None,
        gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=True,
    )


def mark_sequence_parallel(module: nn.Module) -> None:
    """Mark the replicated parameters of `module` (norm gains and biases, RowParallelLinear biases)
    as seeing only a sequence shard: megatron's `param.sequence_parallel = True`.

    Call it on the blocks and the final norm, not on the embedding (which runs before the split).
    Tensor-parallel parameters are left alone: their column/row shards already see every token.
    """
    for param in module.parameters():
        if not is_tensor_parallel(param):
            param.sequence_parallel = True


def register_sequence_parallel_grad_hooks(model: nn.Module) -> list[RemovableHandle]:
    """All-reduce the gradient of every `sequence_parallel` parameter over the TP group, in backward.

    Each TP rank computes such a gradient from its own tokens only, so the true gradient is the sum
    over TP ranks; megatron sums them in finalize_model_grads, after backward. DeepSpeed has no such
    step, and ZeRO-1/2 move each gradient into their flat partitions (and free `param.grad`) from
    a post-accumulate-grad hook while backward runs, so a sum after `engine.backward` would come too
    late. A tensor hook on the parameter runs on the gradient before it is accumulated, hence before
    DeepSpeed's hooks: the engine only ever sees the summed gradient (ZeRO-0/1/2, and every
    micro-batch under gradient accumulation). One small all-reduce per parameter and backward; TP
    ranks run the same graph, so they reach the hooks in the same order. Idempotent.
    """
    handles = []
    for param in model.parameters():
        summed = getattr(param, "sequence_parallel", False) and param.requires_grad
        if summed and not getattr(param, "_sequence_parallel_grad_hook", False):
            handles.append(param.register_hook(_sum_over_tensor_parallel_ranks))
            param._sequence_parallel_grad_hook = True
    return handles


def _sum_over_tensor_parallel_ranks(grad: torch.Tensor) -> torch.Tensor:
    # A copy: autograd may hand the same gradient tensor to several inputs (e.g. both sides of an add).
    total = grad.clone()
    dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return total
