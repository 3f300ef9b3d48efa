"""Single-rank GPT checks: plain-PyTorch parity, exact recomputation, GPT-2 initialisation."""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state

from benchmarks.reference_gpt import ReferenceGPT
from scaletrain.config_loader import config_from_dict
from scaletrain.families import build_model
from tests.distributed.harness import run_on_ranks

TINY = {
    "model": {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 16},
    "data": {"vocab_size": 400, "num_sentinels": 4},
    "train": {"seed": 3},
}


def _batch():
    tokens = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(1))
    return tokens, torch.roll(tokens, -1, dims=1)


def _reference_parity(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    config = config_from_dict(TINY)
    model = build_model(config)
    reference = ReferenceGPT(config.model, config.padded_vocab_size)
    reference.load_scaletrain_state(model.state_dict())
    tokens, labels = _batch()
    return {
        "ours": (model(tokens).detach(), model(tokens, labels).detach()),
        "reference": (reference(tokens).detach(), reference(tokens, labels).detach()),
    }


def test_matches_plain_pytorch_gpt_with_the_same_weights():
    result = run_on_ranks(_reference_parity, 1)[0]
    (logits, loss), (reference_logits, reference_loss) = result["ours"], result["reference"]
    assert (logits - reference_logits).abs().max() <= 1e-5
    assert abs(loss.item() - reference_loss.item()) <= 1e-6


def _gradients_with_recomputation(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    results = {}
    for interval in (0, 1, 2):
        config = config_from_dict({**TINY, "train": {"seed": 3, "activation_checkpoint_interval": interval}})
        model = build_model(config)
        tokens, labels = _batch()
        loss = model(tokens, labels)
        loss.backward()
        results[interval] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return results


def test_activation_recomputation_is_exact():
    results = run_on_ranks(_gradients_with_recomputation, 1)[0]
    baseline_loss, baseline_grads = results[0]
    for interval in (1, 2):
        loss, grads = results[interval]
        assert torch.equal(loss, baseline_loss)
        for name, grad in baseline_grads.items():
            assert torch.equal(grads[name], grad), f"{name} differs with checkpoint interval {interval}"


def _weight_statistics(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    config = config_from_dict({**TINY, "model": {**TINY["model"], "hidden_size": 256, "num_heads": 4}})
    model = build_model(config)
    return {name: (p.detach().std().item(), p.detach().mean().item()) for name, p in model.named_parameters()}


def test_gpt2_initialisation():
    """std 0.02 everywhere; residual output projections 0.02 / sqrt(2 * layers) (GPT-2, sec. 2.3)."""
    stats = run_on_ranks(_weight_statistics, 1)[0]
    scaled = 0.02 / math.sqrt(2 * 4)
    assert abs(stats["embedding.word.weight"][0] - 0.02) < 0.001
    assert abs(stats["blocks.0.attention.qkv.weight"][0] - 0.02) < 0.001
    assert abs(stats["blocks.3.attention.output.weight"][0] - scaled) < 0.0005
    assert abs(stats["blocks.3.mlp.proj.weight"][0] - scaled) < 0.0005
    assert stats["blocks.0.attention.qkv.bias"] == (0.0, 0.0)
    assert stats["blocks.0.attention_norm.weight"] == (0.0, 1.0)


def _prefix_lm_behaviour(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    model = build_model(config_from_dict(TINY)).eval()
    tokens, labels = _batch()
    prefix = torch.tensor([6, 6])
    changed_in_prefix, changed_after = tokens.clone(), tokens.clone()
    changed_in_prefix[:, 5] = (tokens[:, 5] + 1) % 400
    changed_after[:, 10] = (tokens[:, 10] + 1) % 400
    with torch.no_grad():
        logits = model(tokens, prefix_lengths=prefix)
        ignored = labels.clone()
        ignored[:, :5] = -100
        return {
            "base": logits,
            "prefix_changed": model(changed_in_prefix, prefix_lengths=prefix),
            "later_changed": model(changed_after, prefix_lengths=prefix),
            "causal_base": model(tokens),
            "causal_changed": model(changed_in_prefix),
            "loss": model(tokens, ignored, prefix_lengths=prefix),
            "labels": ignored,
        }


def test_prefix_lm_attends_bidirectionally_within_the_prefix_only():
    result = run_on_ranks(_prefix_lm_behaviour, 1)[0]
    base = result["base"]
    # Position 0 sees the prefix's last token (5) bidirectionally, but not a later token (10).
    assert (result["prefix_changed"][:, 0] - base[:, 0]).abs().max() > 1e-4
    assert torch.equal(result["later_changed"][:, :10], base[:, :10])
    # Without prefix_lengths the model is causal: changing token 5 leaves positions < 5 alone.
    assert torch.equal(result["causal_changed"][:, :5], result["causal_base"][:, :5])
    assert (result["causal_changed"][:, 5] - result["causal_base"][:, 5]).abs().max() > 1e-4
    expected = torch.nn.functional.cross_entropy(
        base.flatten(0, 1), result["labels"].flatten(), ignore_index=-100
    )
    assert abs(expected.item() - result["loss"].item()) <= 1e-5
