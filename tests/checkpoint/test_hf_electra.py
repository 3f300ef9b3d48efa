"""ELECTRA to and from Hugging Face: the exported ElectraForMaskedLM and ElectraForPreTraining compute
our logits and, from the same sampled tokens, our loss; import inverts export exactly; `plan`'s
parameter counts of the published sizes equal HF's models built from the matching configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import ElectraForMaskedLM, ElectraForPreTraining

from scaletrain.config_loader import load_config
from scaletrain.families import model_counts
from scaletrain.families.electra import hf as conversion
from scaletrain.families.electra.model import replace_masked_tokens
from tests.distributed.harness import run_on_ranks
from tests.model.test_electra import build_electra, electra_batch, electra_config
from tests.train.runs import REPO

SHAPES = {"projected": {}, "unprojected": {"embedding_size": 64, "generator_hidden_size": 64}}


def _export_and_compare(rank: int, world_size: int, out_dir: Path) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    results = {}
    for name, shape in SHAPES.items():
        model = build_electra(1, **shape).eval()
        config = electra_config(**shape)
        state = {key: value.detach().clone() for key, value in model.state_dict().items()
                 if not key.endswith("_extra_state")}
        conversion.export_hf(state, config.model, config.padded_vocab_size, out_dir / name)
        generator = ElectraForMaskedLM.from_pretrained(out_dir / name / "generator").eval()
        discriminator = ElectraForPreTraining.from_pretrained(out_dir / name / "discriminator").eval()
        batch = electra_batch()
        hf_inputs = {"attention_mask": batch["padding_mask"], "token_type_ids": batch["token_types"]}
        with torch.no_grad():
            generator_logits, discriminator_logits = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
            outputs = model(**batch, evaluation=True)
            loss = model(**batch)
            corrupted, replaced = replace_masked_tokens(batch["tokens"], batch["labels"], outputs.generator_logits,
                                                        batch["replacement_uniforms"])
            hf_generator = generator(batch["tokens"], labels=batch["labels"], **hf_inputs)
            hf_discriminator = discriminator(corrupted, labels=replaced.long(), **hf_inputs)
            results[name] = {
                "generator": (generator_logits - hf_generator.logits).abs().max().item(),
                "discriminator": (discriminator_logits - discriminator(batch["tokens"], **hf_inputs).logits
                                  ).abs().max().item(),
                "loss": loss.item(), "hf_loss": (hf_generator.loss + 50.0 * hf_discriminator.loss).item(),
                "replaced": torch.equal(replaced, outputs.replaced),
                "state": state, "imported": conversion.import_hf(out_dir / name),
            }
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_on_ranks(_export_and_compare, 1, tmp_path_factory.mktemp("electra_hf"))[0]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_transformers_computes_our_logits(exported: dict, shape: str):
    assert exported[shape]["generator"] <= 1e-5
    assert exported[shape]["discriminator"] <= 1e-5


@pytest.mark.parametrize("shape", list(SHAPES))
def test_transformers_computes_our_loss_from_the_same_samples(exported: dict, shape: str):
    assert exported[shape]["replaced"]
    assert exported[shape]["hf_loss"] == pytest.approx(exported[shape]["loss"], abs=1e-5)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_import_inverts_export(exported: dict, shape: str):
    state, imported = exported[shape]["state"], exported[shape]["imported"]
    weights = state
    assert sorted(imported) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(imported[name], tensor), name


def test_import_names_the_directories_it_needs(tmp_path: Path):
    with pytest.raises(ValueError, match="generator/config.json"):
        conversion.import_hf(tmp_path)


def _hf_parameters(model_class: type, hf_config) -> int:
    with torch.device("meta"):
        return sum(parameter.numel() for parameter in model_class(hf_config).parameters())  # tied once


@pytest.mark.parametrize(("config_name", "overrides"), [
    # Google's released vocabulary (30522) and 512 positions, as google/electra-*-discriminator
    ("electra_small", ["model.seq_length=512"]),
    ("electra_base", []),
])
def test_counts_of_published_models(config_name: str, overrides: list[str]):
    config = load_config(REPO / "configs" / f"{config_name}.yaml",
                         ["data.vocab_size=30522", "model.vocab_divisible_by=1", *overrides])
    model, vocab = config.model, config.padded_vocab_size
    generator = _hf_parameters(ElectraForMaskedLM, conversion.hf_config(model, model.generator, vocab, 2))
    discriminator = _hf_parameters(ElectraForPreTraining, conversion.hf_config(model, model.discriminator, vocab, 2))
    shared = (vocab + model.seq_length + 2) * model.embedding_width + 2 * model.embedding_width
    assert model_counts(config).total_params == generator + discriminator - shared
    if config_name == "electra_small":
        assert 13e6 < discriminator < 14e6  # ELECTRA-Small: 14M (paper, table 1)
    else:
        assert 108e6 < discriminator < 111e6  # ELECTRA-Base: 110M (paper, table 8)
