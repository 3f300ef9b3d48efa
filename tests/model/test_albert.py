"""ALBERT: TP=2 computes the TP=1 model; each sharing mode is the unshared model with tied weights (same
loss, the shared gradient the sum of the layers'); shared parameters have one name; exact parameter and
FLOPs counts, and the published sizes' counts equal Hugging Face's; what the config refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import AlbertConfig as HFAlbertConfig
from transformers import AlbertForPreTraining

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.families import build_model, model_counts
from scaletrain.families.albert import model as albert
from scaletrain.planner.params import total_parameters
from tests.checkpoint.test_hf_albert import albert_config
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks
from tests.model.test_bert import bert_batch
from tests.model.test_counts import BATCH, measure_model
from tests.train.runs import REPO

SHARING_OF_BLOCK = {"all": ("attention", "mlp", "attention_norm", "mlp_norm"), "attention": ("attention",),
                    "ffn": ("mlp",)}


def _tensor_parallel_run(rank: int, world_size: int) -> dict[int, dict]:
    results = {}
    for tensor_parallel_size in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        model = build_model(albert_config("all", True, tensor_parallel_size))
        batch = bert_batch()
        inputs = {key: batch[key] for key in ("tokens", "token_types", "padding_mask")}
        logits = gather_vocab_shards(model(**inputs))
        model(**batch).backward()
        results[tensor_parallel_size] = {
            "logits": logits, "weights": gather_full_parameters(model),
            "grads": gather_full_parameters(model, lambda param: param.grad),
        }
        parallel_state.destroy_model_parallel()
    return results


def test_tensor_parallel_shared_block_is_the_single_rank_one():
    results = run_on_ranks(_tensor_parallel_run, 2)[0]
    single, split = results[1], results[2]
    assert split["weights"].keys() == single["weights"].keys()
    for name, weight in single["weights"].items():
        assert torch.equal(split["weights"][name], weight), name  # the init does not depend on the layout
    torch.testing.assert_close(split["logits"], single["logits"], rtol=1e-5, atol=1e-5)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _sharing_equals_tied_unshared(rank: int, world_size: int) -> dict[str, dict]:
    """Each sharing mode against `none` given the shared weights in every layer."""
    parallel_state.initialize_model_parallel()
    results = {}
    for sharing in SHARING_OF_BLOCK:
        shared_model = build_model(albert_config(sharing, True))
        unshared = build_model(albert_config("none", True))
        shared_weights = dict(shared_model.named_parameters())
        with torch.no_grad():
            for name, param in unshared.named_parameters():
                rest = name.removeprefix("blocks.").partition(".")[2]
                own = name if name in shared_weights else f"{albert.SHARED}.{rest}"
                param.copy_(shared_weights[own])
        losses = {}
        for label, model in (("shared", shared_model), ("unshared", unshared)):
            losses[label] = model(**bert_batch())
            losses[label].backward()
        names_in_state = [name for name in shared_model.state_dict() if not name.endswith("_extra_state")]
        results[sharing] = {
            "losses": {label: loss.item() for label, loss in losses.items()},
            "shared_grads": {name: param.grad for name, param in shared_model.named_parameters()},
            "unshared_grads": {name: param.grad for name, param in unshared.named_parameters()},
            "state_names": names_in_state,
            "parameter_names": [name for name, _ in shared_model.named_parameters()],
        }
    return results


@pytest.fixture(scope="module")
def sharing_runs() -> dict[str, dict]:
    return run_on_ranks(_sharing_equals_tied_unshared, 1)[0]


@pytest.mark.parametrize("sharing", list(SHARING_OF_BLOCK))
def test_sharing_is_the_unshared_model_with_tied_weights(sharing_runs, sharing: str):
    run = sharing_runs[sharing]
    assert run["losses"]["shared"] == pytest.approx(run["losses"]["unshared"], rel=1e-6)
    layers = albert_config(sharing, True).model.num_layers
    for name, grad in run["shared_grads"].items():
        if name.startswith(albert.SHARED):
            rest = name.removeprefix(f"{albert.SHARED}.")
            expected = sum(run["unshared_grads"][f"blocks.{layer}.{rest}"] for layer in range(layers))
        else:
            expected = run["unshared_grads"][name]
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("sharing", list(SHARING_OF_BLOCK))
def test_shared_parameters_have_one_name(sharing_runs, sharing: str):
    run = sharing_runs[sharing]
    assert sorted(run["state_names"]) == sorted(run["parameter_names"])  # no second copy in state_dict
    shared = {name.removeprefix(f"{albert.SHARED}.").split(".")[0]
              for name in run["parameter_names"] if name.startswith(albert.SHARED)}
    assert shared == set(SHARING_OF_BLOCK[sharing])
    if sharing == "all":
        assert {name.removeprefix(f"{albert.SHARED}.") for name in run["parameter_names"]
                if name.startswith(albert.SHARED)} == set(albert.BLOCK_WEIGHTS)
        assert not any(name.startswith("blocks.") for name in run["parameter_names"])


# Counts: against the real model's tensors and torch's FlopCounterMode (tests/model/test_counts.py).
COUNTED = {
    f"{sharing}_{pairs}": [f"model.sharing={sharing}", f"objective.sentence_pairs={pairs}"]
    for sharing in ("all", "attention", "ffn", "none") for pairs in ("none", "sop")
}


def _counted_config(name: str, data_dir: Path):
    return load_config(REPO / "configs" / "albert_tiny.yaml", [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=0",
        "model.vocab_divisible_by=96", f"train.micro_batch_size={BATCH}", "model.num_layers=3",
        "model.hidden_size=48", "model.num_heads=6", "model.seq_length=40", "model.ffn_hidden_size=80",
        "model.embedding_size=20", *COUNTED[name],
    ])


def _measure(rank: int, world_size: int, data_dir: Path) -> dict[str, dict]:
    parallel_state.initialize_model_parallel()
    return {name: measure_model(_counted_config(name, data_dir)) for name in COUNTED}


@pytest.fixture(scope="module")
def measured(small_dataset: Path) -> dict[str, dict]:
    return run_on_ranks(_measure, 1, small_dataset)[0]


@pytest.mark.parametrize("name", list(COUNTED))
def test_counts_are_the_models(measured, small_dataset: Path, name: str):
    config = _counted_config(name, small_dataset)
    counts = model_counts(config)
    assert counts.total_params == measured[name]["total"] == total_parameters(config)
    assert counts.embedding_params == (config.padded_vocab_size + 40 + 2) * 20
    labelled = measured[name]["labelled_per_sample"]
    per_batch = albert.counts(config, labelled=sum(labelled) / len(labelled))  # this batch's labelled positions
    assert per_batch.flops_per_token * BATCH * config.model.seq_length == pytest.approx(measured[name]["flops"],
                                                                                      rel=1e-12)


@pytest.mark.parametrize("config_name", ["albert_base", "albert_xxlarge"])
@pytest.mark.parametrize("overrides", [[], ["data.vocab_size=30000", "model.vocab_divisible_by=1"]])
def test_published_sizes_count_as_hugging_face(config_name: str, overrides: list[str]):
    """HF's AlbertForPreTraining (MLM + SOP heads, decoder tied) of the same shape at our padded vocabulary."""
    config = load_config(REPO / "configs" / f"{config_name}.yaml", overrides)
    model = config.model
    with torch.device("meta"):
        hf_model = AlbertForPreTraining(HFAlbertConfig(
            vocab_size=config.padded_vocab_size, embedding_size=model.embedding_size, hidden_size=model.hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
            intermediate_size=model.ffn_size, max_position_embeddings=model.seq_length,
        ))
    assert model_counts(config).total_params == sum(param.numel() for param in hf_model.parameters())


def test_published_sizes():
    """Lan et al. 2020, table 1: base 12M; xxlarge 235M there, 223M in the released model."""
    assert 11.5e6 < model_counts(load_config(REPO / "configs" / "albert_base.yaml")).total_params < 12.5e6
    assert 222e6 < model_counts(load_config(REPO / "configs" / "albert_xxlarge.yaml")).total_params < 236e6


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.sharing=layers"], "model.sharing='layers'; use all"),
    (["model.embedding_size=0"], "model.embedding_size=0"),
    (["model.sharing=attention", "parallel.pipeline=2"], "pipeline ALBERT with model.sharing=all or none"),
    (["parallel.pipeline=2", "train.activation_checkpoint_interval=1"], "use train.activation_checkpoint=selective"),
    (["parallel.pipeline=2", "train.activation_checkpoint=full"], "not the shared block it runs"),
])
def test_config_refuses(overrides: list[str], message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "albert_tiny.yaml", overrides)
