"""Hugging Face export/import: `transformers` computes our logits from exported weights (TP=1 and TP=2),
import inverts export exactly, and an HF-initialised model imports into a TP=2 scaletrain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, GPT2Config, GPT2LMHeadModel

from scaletrain.config_loader import config_from_dict
from scaletrain.families import build_model
from scaletrain.families.bert import hf as bert
from scaletrain.families.gpt import hf as gpt
from scaletrain.parallel.sharding import is_tensor_parallel, split_for_rank
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks
from tests.model.test_bert import TINY, bert_batch, build_bert

# Each family's conversion module (checkpoint/hf/), by family name.
CONVERSIONS = {"gpt": gpt, "bert": bert}
# (scaletrain family, HF class to load the export with, BERT options)
MODELS = {
    "gpt": ("gpt", GPT2LMHeadModel, {}),
    "bert": ("bert", BertForMaskedLM, {}),
    "bert_sentence_order": ("bert", BertForPreTraining, {"sentence_order_head": True}),
}


def _build(name: str, tensor_parallel_size: int) -> torch.nn.Module:
    family, _, options = MODELS[name]
    if family == "gpt":
        return build_model(config_from_dict({**TINY, "parallel": {"tensor": tensor_parallel_size}}))
    return build_bert(tensor_parallel_size, **options)


def _inputs(family: str) -> dict[str, torch.Tensor]:
    batch = bert_batch()
    if family == "gpt":
        return {"tokens": batch["tokens"]}
    return {key: batch[key] for key in ("tokens", "token_types", "padding_mask")}


def _load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Give each rank its shard of a TP=1 state dict."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    assert set(full) == {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_tensor_parallel(param):
                param.copy_(split_for_rank(full[name], param.partition_dim, param.partition_stride, rank, world))
            else:
                param.copy_(full[name])


def _perturbed(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Seeded noise on every weight, so biases and LayerNorms are not 0 and 1 and a swapped one shows."""
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(index))
        for index, (name, tensor) in enumerate(sorted(full.items()))
    }


def _export_and_import(rank: int, world_size: int, out_dir: Path, native_dirs: dict[str, Path]) -> dict:
    """Both layouts in one pair of processes (TP=1 is data-parallel here), which halves the start-up time."""
    results = {}
    for tensor_parallel_size in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        results[tensor_parallel_size] = _export_at(rank, tensor_parallel_size, out_dir, native_dirs)
        parallel_state.destroy_model_parallel()
    return results


def _export_at(rank: int, tensor_parallel_size: int, out_dir: Path, native_dirs: dict[str, Path]) -> dict:
    config = config_from_dict(TINY)
    results = {}
    for name in MODELS:
        family = MODELS[name][0]
        model = _build(name, tensor_parallel_size).eval()
        _load_full_state(model, _perturbed(gather_full_parameters(model)))
        state = gather_full_parameters(model)
        if rank == 0:
            export_dir = out_dir / f"{name}_tp{tensor_parallel_size}"
            CONVERSIONS[family].export_hf(state, config.model, config.padded_vocab_size, export_dir)
        results[name] = {"state": state, "logits": gather_vocab_shards(model(**_inputs(family)))}
        if name == "bert_sentence_order":
            results[name]["sentence_order_logits"] = model.sentence_order_logits(**_inputs(family)).detach()
        if name in native_dirs:
            # An HF-initialised checkpoint, imported and sharded over this run's ranks.
            _load_full_state(model, CONVERSIONS[family].import_hf(native_dirs[name]))
            results[name]["native_logits"] = gather_vocab_shards(model(**_inputs(family)))
    return results


def _hf_logits(hf_model: torch.nn.Module, family: str) -> torch.Tensor:
    inputs = _inputs(family)
    with torch.no_grad():
        if family == "gpt":
            return hf_model(input_ids=inputs["tokens"]).logits
        output = hf_model(
            input_ids=inputs["tokens"], token_type_ids=inputs["token_types"], attention_mask=inputs["padding_mask"]
        )
        return output.logits if hasattr(output, "logits") else output.prediction_logits


def _native_hf_models(directory: Path) -> dict[str, Path]:
    """HF models initialised by `transformers` (then perturbed), saved with save_pretrained."""
    model = TINY["model"]
    shapes = {"vocab_size": 512, "hidden_size": model["hidden_size"], "num_hidden_layers": model["num_layers"],
              "num_attention_heads": model["num_heads"], "intermediate_size": 4 * model["hidden_size"],
              "max_position_embeddings": model["seq_length"], "layer_norm_eps": 1e-5}
    torch.manual_seed(0)
    hf_models = {
        "gpt": GPT2LMHeadModel(GPT2Config(
            vocab_size=512, n_positions=model["seq_length"], n_embd=model["hidden_size"], n_layer=model["num_layers"],
            n_head=model["num_heads"], bos_token_id=2, eos_token_id=3,
        )),
        "bert": BertForMaskedLM(BertConfig(**shapes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    }
    dirs = {}
    for name, hf_model in hf_models.items():
        with torch.no_grad():
            for param in hf_model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        dirs[name] = directory / f"native_{name}"
        hf_model.save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict[int, dict]]:
    out_dir = tmp_path_factory.mktemp("hf_export")
    native_dirs = _native_hf_models(out_dir)
    return out_dir, native_dirs, run_on_ranks(_export_and_import, 2, out_dir, native_dirs)[0]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_computes_our_logits(exported, name: str, tensor_parallel_size: int):
    """GPT with tokens; BERT with two segments and padding, HF given the same attention_mask."""
    out_dir, _, results = exported
    family, hf_class, _ = MODELS[name]
    ours = results[tensor_parallel_size][name]
    hf_model = hf_class.from_pretrained(out_dir / f"{name}_tp{tensor_parallel_size}").eval()
    assert type(hf_model) is hf_class
    diff = (_hf_logits(hf_model, family) - ours["logits"]).abs().max().item()
    print(f"{name} TP={tensor_parallel_size}: max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-4
    if "sentence_order_logits" in ours:
        inputs = _inputs(family)
        with torch.no_grad():
            hf_pair_logits = hf_model(
                input_ids=inputs["tokens"], token_type_ids=inputs["token_types"], attention_mask=inputs["padding_mask"]
            ).seq_relationship_logits
        assert (hf_pair_logits - ours["sentence_order_logits"]).abs().max() <= 1e-4


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_import_inverts_export(exported, name: str, tensor_parallel_size: int):
    out_dir, _, results = exported
    ours = results[tensor_parallel_size][name]["state"]
    imported = CONVERSIONS[MODELS[name][0]].import_hf(out_dir / f"{name}_tp{tensor_parallel_size}")
    assert imported.keys() == ours.keys()
    for weight_name, tensor in ours.items():
        assert torch.equal(imported[weight_name], tensor), weight_name


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_hf_initialised_model_imports_and_shards(exported, name: str, tensor_parallel_size: int):
    _, native_dirs, results = exported
    family, hf_class, _ = MODELS[name]
    hf_logits = _hf_logits(hf_class.from_pretrained(native_dirs[name]).eval(), family)
    diff = (results[tensor_parallel_size][name]["native_logits"] - hf_logits).abs().max().item()
    print(f"HF-initialised {name} at TP={tensor_parallel_size}: max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-4


def test_export_explains_what_it_cannot_write(exported, tmp_path: Path):
    _, _, results = exported
    model_config = config_from_dict(TINY).model
    shard = dict(results[1]["gpt"]["state"])
    shard["embedding.word.weight"] = shard["embedding.word.weight"][:256]
    with pytest.raises(ValueError, match="256 rows but vocab_size=512"):
        gpt.export_hf(shard, model_config, 512, tmp_path)
    norm = torch.ones(TINY["model"]["hidden_size"])
    pre_layernorm = {**results[1]["bert"]["state"], "final_norm.weight": norm, "final_norm.bias": 0 * norm}
    with pytest.raises(ValueError, match="pre-LN"):
        bert.export_hf(pre_layernorm, model_config, 512, tmp_path)
    with pytest.raises(ValueError, match="has weights a gpt model does not"):
        gpt.export_hf(results[1]["bert"]["state"] | results[1]["gpt"]["state"], model_config, 512, tmp_path)
