"""Exact counts: parameters equal the real models' tensors, FLOPs equal torch's FlopCounterMode.

FlopCounterMode counts matmuls (mm, addmm, bmm) but not the fused CPU attention kernel, so the
FLOPs check runs attention through SDPA's math backend, which decomposes into counted bmm's.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.config import Config, load_config
from scaletrain.model import build_model
from scaletrain.scaling.counts import bert_counts, model_counts, t5_decoder_length
from scaletrain.tracking.flops import model_flops_per_token
from tests.distributed.harness import run_on_ranks
from tests.train.runs import REPO

BATCH = 3
EMBEDDING_TABLES = ("embedding.word.weight", "embedding.position.weight", "embedding.token_type.weight",
                    "embedding.weight", "relative_position_bias.weight")
VARIANTS = {
    "gpt": ["model.family=gpt"],
    "gpt_wide_ffn": ["model.family=gpt", "model.ffn_hidden_size=80", "model.num_layers=3"],
    "bert_post": ["model.family=bert"],
    "bert_pre_sop": ["model.family=bert", "model.layernorm_position=pre", "objective.sentence_pairs=sop"],
    "t5_relu_tied": ["model.family=t5", "model.ffn_activation=relu"],
    "t5_gated_untied": ["model.family=t5", "model.tie_embeddings=false", "model.head_dim=12",
                        "model.num_decoder_layers=3"],
    "t5_prefix_lm": ["model.family=t5", "objective.kind=prefix_lm"],
}


def tiny_config(overrides: list[str]) -> Config:
    return load_config(REPO / "configs" / "gpt_tiny.yaml", [
        "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=24",
        "data.vocab_size=1000", "data.num_sentinels=16", "model.vocab_divisible_by=64", *overrides,
    ])


def batch_for(config: Config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    seq, vocab = config.model.seq_length, config.data.vocab_size
    tokens = torch.randint(10, vocab, (BATCH, seq), generator=generator)
    if config.model.family == "gpt":
        return {"tokens": tokens, "labels": tokens.roll(-1, dims=1)}
    if config.model.family == "bert":
        labels = tokens.masked_fill(torch.rand(BATCH, seq, generator=generator) > 0.15, -100)
        batch = {"tokens": tokens, "token_types": torch.zeros_like(tokens), "padding_mask": torch.ones_like(tokens),
                 "labels": labels}
        if config.objective.sentence_pairs != "none":
            batch["sentence_order_labels"] = torch.tensor([0, 1, 0])
        return batch
    targets = torch.randint(10, vocab, (BATCH, t5_decoder_length(config)), generator=generator)
    return {"encoder_tokens": tokens, "decoder_tokens": targets, "labels": targets}


def count_model(rank: int, world_size: int) -> dict[str, dict]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    measured = {}
    for name, overrides in VARIANTS.items():
        config = tiny_config(overrides)
        model = build_model(config)
        parameters = dict(model.named_parameters())  # unique tensors: a tied weight appears once
        batch = batch_for(config, torch.Generator().manual_seed(0))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(**batch).backward()
        labelled = (batch["labels"] != -100).double().mean().item() if config.model.family == "bert" else None
        measured[name] = {
            "total": sum(p.numel() for p in parameters.values()),
            "embedding": sum(p.numel() for n, p in parameters.items() if n.endswith(EMBEDDING_TABLES)),
            "flops": counter.get_total_flops(), "labelled_fraction": labelled,
        }
    return measured


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    return run_on_ranks(count_model, 1)[0]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_counts_match_the_model(measured: dict, name: str) -> None:
    counts = model_counts(tiny_config(VARIANTS[name]))
    assert counts.total_params == measured[name]["total"]
    assert counts.embedding_params == measured[name]["embedding"]
    assert counts.non_embedding_params == counts.total_params - counts.embedding_params > 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_flops_match_the_flop_counter(measured: dict, name: str) -> None:
    config = tiny_config(VARIANTS[name])
    counts = model_counts(config)
    if config.model.family == "bert":  # the head runs on this batch's labelled positions only
        counts = bert_counts(config, labelled_fraction=measured[name]["labelled_fraction"])
    expected = counts.flops_per_token * BATCH * config.model.seq_length
    assert expected == pytest.approx(measured[name]["flops"], rel=1e-9)


def test_gpt_flops_are_the_planner_formula() -> None:
    config = tiny_config(VARIANTS["gpt_wide_ffn"])
    assert model_counts(config).flops_per_token == model_flops_per_token(config.model, config.padded_vocab_size)


def test_counts_of_a_published_size() -> None:
    """GPT-3 125M (Brown et al. 2020, table 2.1): ~125M parameters, 85M of them outside the embeddings."""
    counts = model_counts(load_config(REPO / "configs" / "gpt3_125m.yaml"))
    assert 120e6 < counts.total_params < 130e6
    assert 84e6 < counts.non_embedding_params < 86e6
