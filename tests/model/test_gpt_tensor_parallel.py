"""TP=2 computes the same GPT as TP=1: same initial weights, logits, loss and gradients."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks

TINY = {
    "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16},
    "data": {"vocab_size": 400, "num_sentinels": 4},
    "train": {"seed": 7},
}


def _forward_backward(rank: int, world_size: int, tensor_parallel_size: int) -> dict:
    config = config_from_dict({**TINY, "parallel": {"tensor": tensor_parallel_size}})
    validate(config)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    model = build_model(config)
    tokens = torch.randint(0, config.data.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    logits = model(tokens)
    loss = model(tokens, labels)
    loss.backward()
    full_logits = gather_vocab_shards(logits)
    return {
        "logits": full_logits,
        "loss": loss.detach(),
        "weights": gather_full_parameters(model),
        "grads": gather_full_parameters(model, lambda p: p.grad),
    }


def test_tensor_parallel_matches_single_rank():
    reference = run_on_ranks(_forward_backward, 1, 1)[0]
    sharded = run_on_ranks(_forward_backward, 2, 2)
    assert torch.equal(sharded[0]["loss"], sharded[1]["loss"])
    result = sharded[0]
    for name, weight in reference["weights"].items():
        assert torch.equal(result["weights"][name], weight), f"initial weight {name} differs across layouts"
    assert (result["logits"] - reference["logits"]).abs().max() <= 1e-5
    assert abs(result["loss"].item() - reference["loss"].item()) <= 1e-5
    for name, grad in reference["grads"].items():
        diff = (result["grads"][name] - grad).abs().max().item()
        assert diff <= 1e-5, f"gradient of {name} differs by {diff}"


def test_loss_is_cross_entropy_of_gathered_logits():
    """The vocab-parallel loss equals torch's cross-entropy on the full logits."""
    result = run_on_ranks(_forward_backward, 2, 2)[0]
    tokens = torch.randint(0, 400, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    expected = torch.nn.functional.cross_entropy(result["logits"].flatten(0, 1), labels.flatten())
    assert abs(expected.item() - result["loss"].item()) <= 1e-5
