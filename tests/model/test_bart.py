"""BART: TP=2 computes the TP=1 model; masks hold; the KV cache decodes what recomputation does;
counts equal the real model's parameters and FLOPs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import BartConfig as HFBartConfig
from transformers import BartForConditionalGeneration

from scaletrain.config_loader import load_config
from scaletrain.families import model_counts
from scaletrain.families.bart.model import BART, BartArchitecture
from scaletrain.model.sampling import sample_seq2seq
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks
from tests.model.test_counts import measure_model
from tests.model.test_t5 import CHANGED_FROM, mp_config
from tests.test_generate import _greedy_seq2seq_by_recomputation
from tests.train.runs import REPO

ARCHITECTURE = BartArchitecture(
    vocab_size=400, hidden_size=64, num_heads=4, ffn_hidden_size=128, num_encoder_layers=2, num_decoder_layers=3,
    max_position_embeddings=16,
)
SEED = 11
EOS = 3


def bart_batch() -> dict[str, torch.Tensor]:
    """A padded denoising-shaped batch: 3 sequences, encoder length 12, decoder length 9, start eos."""
    generator = torch.Generator().manual_seed(0)
    encoder_lengths, decoder_lengths = torch.tensor([12, 9, 5]), torch.tensor([9, 7, 4])
    encoder_padding_mask = (torch.arange(12)[None, :] < encoder_lengths[:, None]).long()
    decoder_padding_mask = (torch.arange(9)[None, :] < decoder_lengths[:, None]).long()
    encoder_tokens = torch.randint(7, 390, (3, 12), generator=generator) * encoder_padding_mask
    targets = torch.randint(7, 390, (3, 9), generator=generator) * decoder_padding_mask
    decoder_tokens = torch.cat([torch.full((3, 1), EOS), targets[:, :-1]], dim=1)
    return {
        "encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens,
        "labels": targets.masked_fill(decoder_padding_mask == 0, -100),
        "encoder_padding_mask": encoder_padding_mask, "decoder_padding_mask": decoder_padding_mask,
    }


def _forward_backward(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    batch = bart_batch()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    model = BART(ARCHITECTURE, mp_config(world_size), seed=SEED)
    weights = gather_full_parameters(model)
    logits = gather_vocab_shards(model(**inputs).detach())
    loss = model(**batch)
    loss.backward()
    generator = torch.Generator().manual_seed(5)
    later_changed = {**inputs, "decoder_tokens": inputs["decoder_tokens"].clone()}
    later_changed["decoder_tokens"][:, CHANGED_FROM:] = torch.randint(7, 390, (3, 9 - CHANGED_FROM),
                                                                      generator=generator)
    padding = inputs["encoder_padding_mask"] == 0
    padding_changed = {**inputs, "encoder_tokens": torch.where(padding, torch.randint(7, 390, padding.shape),
                                                               inputs["encoder_tokens"])}
    unpadded = {key: value for key, value in inputs.items() if not key.endswith("padding_mask")}
    with torch.no_grad():
        probes = {name: gather_vocab_shards(model(**probe)) for name, probe in
                  [("later_changed", later_changed), ("padding_changed", padding_changed), ("unpadded", unpadded)]}
    return {"weights": weights, "logits": logits, "loss": loss.detach(),
            "grads": gather_full_parameters(model, lambda p: p.grad), **probes}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    return run_on_ranks(_forward_backward, 1)[0]


@pytest.mark.slow
def test_tensor_parallel_matches_single_rank(single_rank: dict):
    reference, sharded = single_rank, run_on_ranks(_forward_backward, 2)[0]
    assert reference["weights"].keys() == sharded["weights"].keys()
    for name, weight in reference["weights"].items():
        assert torch.equal(sharded["weights"][name], weight), f"initial weight {name} differs across layouts"
    assert (sharded["logits"] - reference["logits"]).abs().max() <= 1e-5
    assert abs(sharded["loss"].item() - reference["loss"].item()) <= 1e-5
    for name, grad in reference["grads"].items():
        assert (sharded["grads"][name] - grad).abs().max().item() <= 1e-5, f"gradient of {name} differs"
        assert grad.abs().max() > 0, f"{name} got no gradient"


def test_decoder_is_causal_and_encoder_padding_is_masked(single_rank: dict):
    logits = single_rank["logits"]
    later = single_rank["later_changed"]
    assert torch.equal(later[:, :CHANGED_FROM], logits[:, :CHANGED_FROM])
    assert not torch.equal(later[:, CHANGED_FROM:], logits[:, CHANGED_FROM:])
    assert torch.equal(single_rank["padding_changed"], logits)
    # Without masks: the full sequences, causal decoder; row 0 has no padding, so it is unchanged.
    assert (single_rank["unpadded"][0] - logits[0]).abs().max() <= 1e-5


def _decode(rank: int, world_size: int) -> tuple[list[int], list[int]]:
    parallel_state.initialize_model_parallel()
    model = BART(replace(ARCHITECTURE, max_position_embeddings=24, init_std=0.1), mp_config(1), seed=SEED).eval()
    prompt = torch.randint(7, 390, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    cached = sample_seq2seq(model, prompt, 12, 400, 0.0, None, torch.Generator(), start_token=0)
    return cached, _greedy_seq2seq_by_recomputation(model, prompt, 12)


def test_greedy_decoding_with_the_cache_matches_recomputation():
    """Learned decoder positions continue past the cached ones."""
    cached, recomputed = run_on_ranks(_decode, 1)[0]
    assert cached == recomputed and len(set(cached)) > 1


VARIANTS = {
    "small": ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=24"],
    "uneven_positions": ["model.num_layers=1", "model.num_decoder_layers=2", "model.hidden_size=48",
                         "model.num_heads=6", "model.seq_length=40", "model.ffn_hidden_size=80",
                         "model.max_position_embeddings=50", "objective.noising=[text_infilling,token_deletion]"],
}


def tiny_config(name: str, data_dir: Path):
    return load_config(REPO / "configs" / "bart_tiny.yaml", [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=0",
        "model.vocab_divisible_by=96", "train.micro_batch_size=3", *VARIANTS[name],
    ])


def _measure(rank: int, world_size: int, data_dir: Path) -> dict:
    parallel_state.initialize_model_parallel()
    return {name: measure_model(tiny_config(name, data_dir)) for name in VARIANTS}


@pytest.fixture(scope="module")
def measured(small_dataset: Path) -> dict[str, dict]:
    return run_on_ranks(_measure, 1, small_dataset)[0]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_counts_match_the_model(measured: dict, small_dataset: Path, name: str):
    """Parameters one by one; FLOPs as torch's FlopCounterMode counts one training step (SDPA's math
    kernel, as tests/model/test_counts.py explains)."""
    measured = measured[name]
    config = tiny_config(name, small_dataset)
    counts = model_counts(config)
    assert counts.total_params == measured["total"]
    assert measured["shapes"]["encoder_tokens"] == measured["shapes"]["decoder_tokens"] == (3, config.model.seq_length)
    assert counts.flops_per_token * 3 * config.model.seq_length == pytest.approx(measured["flops"], rel=1e-12)


@pytest.mark.parametrize(("config_name", "vocab", "expected"), [
    ("bart_base", None, 139_450_368), ("bart_large", None, 406_331_392), ("bart_base", 50265, 139_420_416),
])
def test_published_sizes_count_as_hugging_face(config_name: str, vocab: int | None, expected: int):
    """`plan`'s count of the published configs is HF's BartForConditionalGeneration of the same shape
    (shared embedding once, positions with HF's offset of 2; final_logits_bias is a buffer), at our
    padded vocabulary and at BART's own 50265 pieces: ~140M and ~406M (Lewis et al. 2020)."""
    overrides = [] if vocab is None else [f"data.vocab_size={vocab}", "model.vocab_divisible_by=1"]
    config = load_config(REPO / "configs" / f"{config_name}.yaml", overrides)
    model = config.model
    with torch.device("meta"):
        hf_model = BartForConditionalGeneration(HFBartConfig(
            vocab_size=config.padded_vocab_size, d_model=model.hidden_size, encoder_layers=model.num_layers,
            decoder_layers=model.num_decoder_layers, encoder_attention_heads=model.num_heads,
            decoder_attention_heads=model.num_heads, encoder_ffn_dim=model.ffn_size, decoder_ffn_dim=model.ffn_size,
            max_position_embeddings=model.max_position_embeddings,
        ))
    hf_count = sum(param.numel() for param in hf_model.parameters())
    assert model_counts(config).total_params == hf_count == expected
