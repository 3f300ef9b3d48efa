"""Ring attention over context-parallel ranks computes full attention (gloo, CPU): the outputs at each
rank's zigzag positions and the gradients of queries, keys and values, within 1e-5 of one process's SDPA
on the whole sequence, for causal, grouped-query, sliding-window, document and prefix-LM masks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from scaletrain.model.attention_masks import visible_keys
from scaletrain.parallel.context_parallel import local_positions, ring_attention, zigzag_positions
from tests.distributed.harness import run_on_ranks

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8
TOLERANCE = 1e-5
CASES = {  # name: (kv heads, window, documents, prefix)
    "causal": (HEADS, None, False, False),
    "grouped_query": (2, None, False, False),
    "window": (HEADS, 5, False, False),
    "documents": (HEADS, None, True, False),
    "prefix": (HEADS, None, False, True),
}


def _inputs(kv_heads: int, documents: bool, prefix: bool) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.cumsum(torch.rand(BATCH, SEQ, generator=generator) < 0.15, dim=1) if documents else None
    return {
        "query": torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator),
        "key": torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=generator),
        "value": torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=generator),
        "grad": torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator),
        "document_ids": ids,
        "prefix_lengths": torch.tensor([3, 20]) if prefix else None,
    }


def _full_attention(case: str) -> dict[str, torch.Tensor]:
    """One process, the whole sequence: SDPA with the same mask, and its gradients."""
    kv_heads, window, documents, prefix = CASES[case]
    inputs = _inputs(kv_heads, documents, prefix)
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("query", "key", "value")}
    positions = torch.arange(SEQ)
    mask = visible_keys(positions, positions, inputs["prefix_lengths"], inputs["document_ids"], window)
    output = F.scaled_dot_product_attention(leaves["query"], leaves["key"], leaves["value"], attn_mask=mask,
                                            enable_gqa=kv_heads != HEADS)
    output.backward(inputs["grad"])
    return {"output": output.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def _ring(rank: int, world_size: int, cases: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    results = {}
    for case in cases:
        kv_heads, window, documents, prefix = CASES[case]
        inputs = _inputs(kv_heads, documents, prefix)
        positions = local_positions(SEQ, torch.device("cpu"))
        leaves = {name: inputs[name][:, :, positions].clone().requires_grad_() for name in ("query", "key", "value")}
        visible = functools.partial(visible_keys, prefix_lengths=inputs["prefix_lengths"],
                                    document_ids=inputs["document_ids"], window=window)
        output = ring_attention(leaves["query"], leaves["key"], leaves["value"], positions, visible)
        output.backward(inputs["grad"][:, :, positions])
        results[case] = {"positions": positions, "output": output.detach(),
                         **{name: leaf.grad for name, leaf in leaves.items()}}
    return results


def test_zigzag_chunks_cover_the_sequence_once():
    held = torch.cat([zigzag_positions(16, 4, rank) for rank in range(4)])
    assert sorted(held.tolist()) == list(range(16))
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("world_size, cases", [(2, list(CASES)), (4, ["causal", "documents"])])
def test_ring_attention_equals_full_attention(world_size, cases):
    per_rank = run_on_ranks(_ring, world_size, cases)
    for case in cases:
        expected = _full_attention(case)
        for rank in per_rank:
            got = rank[case]
            for name in ("output", "query", "key", "value"):
                want = expected[name][:, :, got["positions"]]
                assert torch.allclose(got[name], want, atol=TOLERANCE, rtol=0), (case, name)
