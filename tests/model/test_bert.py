"""BERT: TP=2 computes the same model as TP=1; padding is masked; masked-LM + sentence-order loss; accuracy; init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model
from scaletrain.model.encoder import BERT
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks

TINY = {
    "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16},
    "data": {"vocab_size": 400, "num_sentinels": 4},
    "train": {"seed": 7},
}
REAL_LENGTHS = (16, 11, 7)  # tokens before padding in each sequence of the batch


def build_bert(
    tensor_parallel_size: int, sentence_order_head: bool = False, layernorm_position: str = "post",
    checkpoint_interval: int = 0,
) -> BERT:
    """The BERT family's model from a config, as training builds it."""
    config = config_from_dict({
        **TINY,
        "model": {**TINY["model"], "family": "bert", "layernorm_position": layernorm_position},
        "objective": {"sentence_pairs": "sop" if sentence_order_head else "none"},
        "parallel": {"tensor": tensor_parallel_size},
        "train": {**TINY["train"], "activation_checkpoint_interval": checkpoint_interval},
    })
    validate(config)
    return build_model(config)


def bert_batch() -> dict[str, torch.Tensor]:
    """Two segments per sequence, right padding, 25% of real tokens labelled, sentence-order labels."""
    generator = torch.Generator().manual_seed(0)
    batch_size, seq_length = len(REAL_LENGTHS), TINY["model"]["seq_length"]
    tokens = torch.randint(7, 400, (batch_size, seq_length), generator=generator)
    positions = torch.arange(seq_length)
    padding_mask = (positions[None, :] < torch.tensor(REAL_LENGTHS)[:, None]).long()
    tokens = torch.where(padding_mask.bool(), tokens, 0)
    token_types = (positions >= seq_length // 2).long().expand(batch_size, -1) * padding_mask
    chosen = (torch.rand(batch_size, seq_length, generator=generator) < 0.25) & padding_mask.bool()
    labels = torch.where(chosen, torch.randint(7, 400, tokens.shape, generator=generator), -100)
    return {
        "tokens": tokens, "token_types": token_types, "padding_mask": padding_mask, "labels": labels,
        "sentence_order_labels": torch.tensor([0, 1, 1]),
    }


def _run_both_layouts(rank: int, world_size: int) -> dict[int, dict]:
    """TP=1 (each rank a whole model, computing alone) and TP=2 in one pair of processes: one start-up."""
    results = {}
    for tensor_parallel_size in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        results[tensor_parallel_size] = _run(tensor_parallel_size)
        parallel_state.destroy_model_parallel()
    return results


def _run(tensor_parallel_size: int) -> dict:
    model = build_bert(tensor_parallel_size, sentence_order_head=True)
    batch = bert_batch()
    inputs = {key: batch[key] for key in ("tokens", "token_types", "padding_mask")}
    logits = gather_vocab_shards(model(**inputs))
    # Other pad tokens and pad segment ids, with and without telling the model where the pads are.
    changed = {**inputs, "tokens": torch.where(batch["padding_mask"].bool(), batch["tokens"], 99),
               "token_types": torch.where(batch["padding_mask"].bool(), batch["token_types"], 1)}
    changed_pads_masked = gather_vocab_shards(model(**changed))
    changed_pads_unmasked = gather_vocab_shards(model(**{**changed, "padding_mask": None}))
    loss = model(**batch)
    loss.backward()
    pre_layernorm = build_bert(tensor_parallel_size, layernorm_position="pre")
    # Labels that are the model's own full-vocabulary argmax at every other labelled position.
    argmax_labels = torch.where(
        (batch["labels"] != -100) & (torch.arange(16) % 2 == 0), logits.argmax(-1), batch["labels"]
    )
    return {
        "logits": logits, "changed_pads_masked": changed_pads_masked, "changed_pads_unmasked": changed_pads_unmasked,
        "loss": loss.detach(), "sentence_order_logits": model.sentence_order_logits(**inputs).detach(),
        "weights": gather_full_parameters(model), "grads": gather_full_parameters(model, lambda param: param.grad),
        "argmax_labels": argmax_labels,
        "accuracy": model.masked_token_accuracy(labels=argmax_labels, **inputs),
        "pre_layernorm_logits": gather_vocab_shards(pre_layernorm(**inputs)),
        "recomputed_grads": _recomputed_grads(tensor_parallel_size, batch),
    }


def _recomputed_grads(tensor_parallel_size: int, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = build_bert(tensor_parallel_size, sentence_order_head=True, checkpoint_interval=1).train()
    model(**batch).backward()
    return gather_full_parameters(model, lambda param: param.grad)


@pytest.fixture(scope="module")
def ranks() -> list[dict[int, dict]]:
    return run_on_ranks(_run_both_layouts, 2)


@pytest.fixture(scope="module")
def single_rank(ranks: list[dict[int, dict]]) -> dict:
    return ranks[0][1]


@pytest.fixture(scope="module")
def two_ranks(ranks: list[dict[int, dict]]) -> list[dict]:
    return [ranks[0][2], ranks[1][2]]


def test_tensor_parallel_matches_single_rank(single_rank: dict, two_ranks: list[dict]):
    assert torch.equal(two_ranks[0]["loss"], two_ranks[1]["loss"])
    sharded = two_ranks[0]
    for name, weight in single_rank["weights"].items():
        assert torch.equal(sharded["weights"][name], weight), f"initial weight {name} differs across layouts"
    for key in ("logits", "pre_layernorm_logits", "sentence_order_logits"):
        assert (sharded[key] - single_rank[key]).abs().max() <= 1e-5, key
    assert abs(sharded["loss"].item() - single_rank["loss"].item()) <= 1e-5
    for name, grad in single_rank["grads"].items():
        diff = (sharded["grads"][name] - grad).abs().max().item()
        assert diff <= 1e-5, f"gradient of {name} differs by {diff}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_padding_mask_blocks_attention_to_pads(single_rank: dict, two_ranks: list[dict], world_size: int):
    result = single_rank if world_size == 1 else two_ranks[0]
    real = bert_batch()["padding_mask"].bool()
    masked_diff = (result["changed_pads_masked"] - result["logits"])[real].abs().max()
    unmasked_diff = (result["changed_pads_unmasked"] - result["logits"])[real].abs().max()
    assert masked_diff <= 1e-6
    assert unmasked_diff > 1e-3, "changing pad tokens should move real-token logits when pads are not masked"


def test_loss_is_masked_cross_entropy_plus_sentence_order(two_ranks: list[dict]):
    """Mean cross-entropy over labelled tokens of the full logits (Devlin et al. 2019) + the pair loss."""
    result, batch = two_ranks[0], bert_batch()
    masked_lm = F.cross_entropy(result["logits"].flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    sentence_order = F.cross_entropy(result["sentence_order_logits"], batch["sentence_order_labels"])
    assert abs(result["loss"].item() - (masked_lm + sentence_order).item()) <= 1e-5


@pytest.mark.parametrize("world_size", [1, 2])
def test_masked_token_accuracy_uses_full_vocabulary_argmax(single_rank: dict, two_ranks: list[dict], world_size: int):
    result = single_rank if world_size == 1 else two_ranks[0]
    labels = result["argmax_labels"]
    labelled = labels != -100
    expected_correct = (result["logits"].argmax(-1) == labels)[labelled].sum()
    correct, count = result["accuracy"]
    assert 0 < expected_correct < labelled.sum(), "the test labels should hold right and wrong predictions"
    assert (correct.item(), count.item()) == (expected_correct.item(), labelled.sum().item())


def test_activation_recomputation_is_exact(single_rank: dict, two_ranks: list[dict]):
    for result in (single_rank, two_ranks[0]):
        for name, grad in result["grads"].items():
            assert torch.equal(result["recomputed_grads"][name], grad), f"{name} differs with recomputation"


def test_bert_initialisation(single_rank: dict):
    """std 0.02 for every weight matrix (BERT's initializer_range), zero biases, LayerNorm ones."""
    weights = single_rank["weights"]
    matrices = ("embedding.word.weight", "blocks.1.attention.qkv.weight", "blocks.1.mlp.proj.weight",
                "lm_head.dense.weight")
    biases = ("blocks.0.attention.qkv.bias", "lm_head.bias", "lm_head.dense.bias", "sentence_order_head.pooler.bias")
    norms = ("embedding.norm.weight", "blocks.0.attention_norm.weight", "lm_head.norm.weight")
    for name in matrices:
        assert abs(weights[name].std().item() - 0.02) < 0.001, name
    for name in biases:
        assert torch.equal(weights[name], torch.zeros_like(weights[name])), name
    for name in norms:
        assert torch.equal(weights[name], torch.ones_like(weights[name])), name
