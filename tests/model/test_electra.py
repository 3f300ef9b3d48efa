"""ELECTRA: TP=2 computes (and samples) what TP=1 does; samples follow the generator's softmax; the
discriminator's labels; the loss; evaluation counts and the histogram AUC; exact parameter counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from scipy import stats
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model, model_counts
from scaletrain.families.electra import FAMILY
from scaletrain.families.electra.model import (
    ELECTRA,
    counts,
    evaluation_counts,
    histogram_auc,
    replace_masked_tokens,
    sample_from_vocab_parallel,
)
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks

VOCAB = 400  # padded to 512
TINY = {
    # E=32 < both widths: both encoders project; generator 1/2 width with 2 heads
    "model": {"family": "electra", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16,
              "embedding_size": 32, "generator_hidden_size": 32, "generator_num_heads": 2},
    "data": {"vocab_size": VOCAB, "num_sentinels": 4},
    "train": {"seed": 7},
}
REAL_LENGTHS = (16, 11, 7)
CHI_SQUARE_VOCAB, CHI_SQUARE_DRAWS = 8, 40_000


def electra_config(tensor_parallel_size: int = 1, **model):
    config = config_from_dict({**TINY, "model": {**TINY["model"], **model},
                               "parallel": {"tensor": tensor_parallel_size}})
    validate(config)
    return config


def build_electra(tensor_parallel_size: int, **model) -> ELECTRA:
    return build_model(electra_config(tensor_parallel_size, **model))


def electra_batch() -> dict[str, torch.Tensor]:
    """Right padding, 25% of real tokens masked (the input holds id 4 there), uniforms per position."""
    generator = torch.Generator().manual_seed(0)
    batch_size, seq_length = len(REAL_LENGTHS), TINY["model"]["seq_length"]
    originals = torch.randint(7, VOCAB, (batch_size, seq_length), generator=generator)
    padding_mask = (torch.arange(seq_length)[None, :] < torch.tensor(REAL_LENGTHS)[:, None]).long()
    originals = torch.where(padding_mask.bool(), originals, 0)
    masked = (torch.rand(batch_size, seq_length, generator=generator) < 0.25) & padding_mask.bool()
    return {
        "tokens": torch.where(masked, 4, originals), "token_types": torch.zeros_like(originals),
        "padding_mask": padding_mask, "labels": torch.where(masked, originals, -100),
        "replacement_uniforms": torch.rand(batch_size, seq_length, generator=generator, dtype=torch.float64),
    }


def _run_both_layouts(rank: int, world_size: int) -> dict[int, dict]:
    results = {}
    for tensor_parallel_size in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        results[tensor_parallel_size] = _run(tensor_parallel_size)
        parallel_state.destroy_model_parallel()
    return results


def _run(tensor_parallel_size: int) -> dict:
    torch.manual_seed(0)
    model = build_electra(tensor_parallel_size)
    batch = electra_batch()
    inputs = {key: batch[key] for key in ("tokens", "token_types", "padding_mask")}
    generator_logits, discriminator_logits = model(**inputs)
    outputs = model(**batch, evaluation=True)
    loss = model(**batch)
    loss.backward()
    # the same full logits on every layout: 3000 rows of a 512-token vocabulary, this rank's shard
    full = 3.0 * torch.randn(3000, 512, generator=torch.Generator().manual_seed(1))
    uniforms = torch.rand(3000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    rank, world = parallel_state.get_tensor_model_parallel_rank(), tensor_parallel_size
    result = {
        "generator_logits": gather_vocab_shards(generator_logits).detach(),
        "discriminator_logits": discriminator_logits.detach(),
        "replaced": outputs.replaced, "loss": loss.detach(),
        "scores": outputs.discriminator_logits.detach(),  # of the corrupted tokens
        "masked_generator_logits": gather_vocab_shards(outputs.generator_logits).detach(),
        "weights": gather_full_parameters(model), "grads": gather_full_parameters(model, lambda param: param.grad),
        "samples": sample_from_vocab_parallel(full.chunk(world, dim=-1)[rank], uniforms),
        "counts": {name: [value.tolist() for value in pair] for name, pair in evaluation_counts(model, batch).items()},
    }
    if tensor_parallel_size == 1:
        result["chi_square_samples"] = _chi_square_samples()
        result["label_cases"] = _label_cases()
        result["parameters"] = sum(parameter.numel() for parameter in model.parameters())
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(**batch).backward()
        result["flops"] = counter.get_total_flops()
        unprojected = build_electra(1, embedding_size=64, generator_hidden_size=64)
        result["parameters_without_projection"] = sum(parameter.numel() for parameter in unprojected.parameters())
    return result


def _chi_square_samples() -> dict:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    uniforms = torch.rand(CHI_SQUARE_DRAWS, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    samples = sample_from_vocab_parallel(logits.expand(CHI_SQUARE_DRAWS, -1), uniforms)
    return {"logits": logits[0], "samples": samples}


def _label_cases() -> dict:
    """Generator logits that put all mass on one token: the original at the first masked position,
    another token at the second."""
    tokens = torch.tensor([[2, 4, 9, 4, 3]])  # [CLS] [MASK] 9 [MASK] [SEP]
    labels = torch.tensor([[-100, 11, -100, 12, -100]])
    logits = torch.full((2, 512), -1e4)
    logits[0, 11], logits[1, 30] = 0.0, 0.0  # position 1 samples its original 11, position 3 samples 30
    corrupted, replaced = replace_masked_tokens(tokens, labels, logits, torch.full((1, 5), 0.5, dtype=torch.float64))
    return {"corrupted": corrupted, "replaced": replaced}


@pytest.fixture(scope="module")
def ranks() -> list[dict[int, dict]]:
    return run_on_ranks(_run_both_layouts, 2)


@pytest.fixture(scope="module")
def single_rank(ranks) -> dict:
    return ranks[0][1]


@pytest.fixture(scope="module")
def two_ranks(ranks) -> list[dict]:
    return [ranks[0][2], ranks[1][2]]


def test_tensor_parallel_matches_single_rank(single_rank: dict, two_ranks: list[dict]):
    sharded = two_ranks[0]
    assert torch.equal(two_ranks[0]["loss"], two_ranks[1]["loss"])
    for name, weight in single_rank["weights"].items():
        assert torch.equal(sharded["weights"][name], weight), f"initial weight {name} differs across layouts"
    for key in ("generator_logits", "discriminator_logits", "masked_generator_logits", "scores"):
        assert (sharded[key] - single_rank[key]).abs().max() <= 1e-5, key
    assert torch.equal(sharded["replaced"], single_rank["replaced"])
    assert abs(sharded["loss"].item() - single_rank["loss"].item()) <= 1e-5
    for name, grad in single_rank["grads"].items():
        diff = (sharded["grads"][name] - grad).abs().max().item()
        assert diff <= 1e-5 * max(1.0, grad.abs().max().item()), f"gradient of {name} differs by {diff}"
    assert sharded["counts"] == single_rank["counts"]


def test_tensor_parallel_samples_the_same_tokens(single_rank: dict, two_ranks: list[dict]):
    assert torch.equal(two_ranks[0]["samples"], two_ranks[1]["samples"])
    assert torch.equal(two_ranks[0]["samples"], single_rank["samples"])
    assert len(set(single_rank["samples"].tolist())) > 100  # a real spread over the vocabulary


def test_samples_follow_the_generator_softmax(single_rank: dict):
    """Pearson's chi-square of 40,000 draws over an 8-token vocabulary against softmax(logits)."""
    case = single_rank["chi_square_samples"]
    observed = np.bincount(case["samples"].numpy(), minlength=CHI_SQUARE_VOCAB)
    expected = F.softmax(case["logits"].double(), dim=-1).numpy() * CHI_SQUARE_DRAWS
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_a_sample_equal_to_the_original_is_not_replaced(single_rank: dict):
    case = single_rank["label_cases"]
    assert case["corrupted"].tolist() == [[2, 11, 9, 30, 3]]
    assert case["replaced"].tolist() == [[False, False, False, True, False]]


def test_discriminator_labels_mark_exactly_the_changed_tokens(single_rank: dict):
    batch = electra_batch()
    replaced = single_rank["replaced"]
    assert not replaced[batch["labels"] == -100].any()  # only masked positions can be replaced
    assert replaced.any() and not replaced.all()


def test_loss_is_generator_mlm_plus_weighted_discriminator(single_rank: dict):
    batch = electra_batch()
    labels = batch["labels"].transpose(0, 1)
    targets = labels[labels != -100]
    generator_loss = F.cross_entropy(single_rank["masked_generator_logits"], targets)
    real = batch["padding_mask"].bool()
    discriminator_loss = F.binary_cross_entropy_with_logits(
        single_rank["scores"][real], single_rank["replaced"][real].float()
    )
    assert single_rank["loss"].item() == pytest.approx((generator_loss + 50.0 * discriminator_loss).item(), abs=1e-5)


def test_evaluation_counts(single_rank: dict):
    batch = electra_batch()
    counts = single_rank["counts"]
    real = batch["padding_mask"].bool()
    scores, replaced = single_rank["scores"][real], single_rank["replaced"][real]
    assert counts["val_discriminator_accuracy"] == [int(((scores > 0) == replaced).sum()), int(real.sum())]
    assert counts["val_replaced_accuracy"] == [int(((scores > 0) & replaced).sum()), int(replaced.sum())]
    positives, negatives = counts["val_discriminator_auc"]
    assert sum(positives) == int(replaced.sum()) and sum(negatives) == int((~replaced).sum())
    assert counts["val_generator_masked_accuracy"][1] == int((batch["labels"] != -100).sum())


def test_histogram_auc_is_the_mann_whitney_statistic():
    generator = torch.Generator().manual_seed(0)
    positives = torch.randn(500, generator=generator) + 1.0
    negatives = torch.randn(700, generator=generator)
    exact = (positives[:, None] > negatives[None, :]).double().mean().item()
    bins = torch.linspace(-16, 16, 4097)
    binned = [torch.histogram(scores, bins).hist for scores in (positives, negatives)]
    assert histogram_auc(*binned) == pytest.approx(exact, abs=1e-3)
    # histograms add over batches and ranks: two halves summed give the same AUC
    halves = [torch.histogram(scores[::2], bins).hist + torch.histogram(scores[1::2], bins).hist
              for scores in (positives, negatives)]
    assert histogram_auc(*halves) == histogram_auc(*binned)
    assert histogram_auc(torch.tensor([0.0, 3.0]), torch.tensor([2.0, 0.0])) == 1.0
    assert histogram_auc(torch.tensor([1.0]), torch.tensor([1.0])) == 0.5
    values = FAMILY.evaluation_values({"val_discriminator_auc": torch.stack([torch.tensor([0.0, 1.0]),
                                                                             torch.tensor([1.0, 0.0])]),
                                       "val_discriminator_accuracy": torch.tensor([3.0, 4.0])})
    assert values == {"val_discriminator_auc": 1.0, "val_discriminator_accuracy": 0.75}


def test_parameter_counts_match_the_model(single_rank: dict):
    assert model_counts(electra_config()).total_params == single_rank["parameters"]
    no_projection = electra_config(embedding_size=64, generator_hidden_size=64)
    assert model_counts(no_projection).total_params == single_rank["parameters_without_projection"]


def test_flops_match_the_flop_counter(single_rank: dict):
    """Both encoders on every token, the generator's head at this batch's masked positions."""
    batch = electra_batch()
    masked = (batch["labels"] != -100).sum().item() / len(REAL_LENGTHS)
    config = electra_config()
    expected = counts(config, labelled=masked).flops_per_token * len(REAL_LENGTHS) * config.model.seq_length
    assert expected == pytest.approx(single_rank["flops"], rel=1e-12)


def test_pipeline_is_refused_naming_what_works():
    with pytest.raises(ConfigError, match="tensor and data parallelism"):
        validate(config_from_dict({**TINY, "parallel": {"pipeline": 2}}))


def test_forward_wants_labels_and_noise_together():
    with pytest.raises(ValueError, match="replacement_uniforms"):
        ELECTRA.forward(None, torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long))
