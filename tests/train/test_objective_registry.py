"""Objectives are registered units that family specs name: every name a family lists is registered,
and one that is not is a single error listing the known ones. An objective only one family trains is
that family's own (its folder's, in its spec), and no other family names it."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict
from scaletrain.data.masking import MaskedLMCollator
from scaletrain.data.objectives import CausalLMCollator, PrefixLMCollator, TokenizerInfo
from scaletrain.data.seq2seq import EncoderDecoderPrefixLMCollator
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families import FAMILIES, get_family
from scaletrain.families.t5.span_corruption import SpanCorruptionCollator
from scaletrain.train.objective import SHARED_OBJECTIVES, build_objective, registered_objectives, training_objective


def test_every_objective_a_family_names_is_registered():
    for name in FAMILIES:
        for objective in get_family(name).objectives + get_family(name).pipeline_objectives:
            assert training_objective(objective) is registered_objectives()[objective]


def test_a_familys_own_objective_is_named_by_it_alone_and_a_shared_one_by_several():
    owners = {objective.name: name for name in FAMILIES for objective in get_family(name).own_objectives}
    assert owners == {"span_corruption": "t5", "replaced_token_detection": "electra", "denoising": "bart"}
    for name in FAMILIES:
        for objective in get_family(name).objectives:
            assert owners.get(objective, name) == name, (name, objective)
    for shared in SHARED_OBJECTIVES:
        assert sum(shared.name in get_family(name).objectives for name in FAMILIES) >= 2, shared.name
        assert shared.name not in owners


def test_an_unregistered_objective_lists_the_known_ones():
    with pytest.raises(ConfigError, match="'ul2' is not a registered training objective; the known ones are "
                                          "causal_lm, prefix_lm, mlm, span_corruption"):
        training_objective("ul2")


@pytest.mark.parametrize(("family", "kind", "collator_class"), [
    ("gpt", "causal_lm", CausalLMCollator),
    ("gpt", "prefix_lm", PrefixLMCollator),
    ("t5", "prefix_lm", EncoderDecoderPrefixLMCollator),
    ("t5", "span_corruption", SpanCorruptionCollator),
    ("bert", "mlm", MaskedLMCollator),
])
def test_each_objective_builds_its_collator(small_dataset, family: str, kind: str, collator_class: type):
    config = config_from_dict({"model": {"family": family, "seq_length": 32}, "objective": {"kind": kind},
                               "data": {"vocab_size": 1024, "num_sentinels": 16}})
    info = TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset / "tokenizer.model"))
    collator = training_objective(kind).collator(config, info, get_family(family))
    assert isinstance(collator, collator_class)


@pytest.mark.parametrize("kind", ["causal_lm", "prefix_lm"])
@pytest.mark.parametrize("model", [{"document_masking": True}, {"document_positions": True}, {}])
def test_decoder_batches_carry_document_ids_when_the_model_reads_them(small_dataset, kind: str, model: dict):
    """The packed samples of the real dataset, with document ids counted from the eos separators."""
    config = config_from_dict({"model": {"family": "llama", "seq_length": 32, **model}, "objective": {"kind": kind},
                               "data": {"dir": str(small_dataset), "vocab_size": 1024, "num_sentinels": 16}})
    objective = build_objective(config)
    eos_id = TokenizerInfo.from_tokenizer(Tokenizer.load(small_dataset / "tokenizer.model")).eos_id
    dataset = objective.dataset("train", shuffle=False)
    # the documents are whole plays: pick the samples that cross a boundary, and one that does not
    crossing = [index for index in range(dataset.order.num_samples) if eos_id in dataset[index]["tokens"][:-1]]
    batch = objective.collate([dataset[index] for index in [0, *crossing[:3]]])
    if not model:
        assert "document_ids" not in batch
        return
    eos = batch["tokens"] == eos_id
    assert eos[1:].any(dim=1).all() and not eos[0].any()
    assert torch.equal(batch["document_ids"], eos.cumsum(dim=1))
