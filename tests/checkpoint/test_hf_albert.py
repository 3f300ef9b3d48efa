"""ALBERT to and from Hugging Face: `transformers` computes our MLM and sentence-order logits from the
exported weights (one shared block -> one layer group, no sharing -> a group per layer; TP=1 and TP=2),
import inverts export exactly, an HF-initialised ALBERT imports, and sublayer-only sharing is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import AlbertConfig, AlbertForMaskedLM, AlbertForPreTraining

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model
from scaletrain.families.albert import hf as albert
from tests.checkpoint.test_export_cli import _inputs as bert_inputs
from tests.checkpoint.test_export_cli import _our_logits
from tests.checkpoint.test_hf_export import _load_full_state, _perturbed
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks
from tests.model.test_bert import TINY, bert_batch
from tests.train.runs import REPO, read_metrics, run_scaletrain, tiny_overrides

EMBEDDING_SIZE = 24
# name -> (model.sharing, sentence-order head, the HF class the export loads as)
MODELS = {
    "shared_sop": ("all", True, AlbertForPreTraining),
    "unshared_mlm": ("none", False, AlbertForMaskedLM),
}


def albert_config(sharing: str, sentence_order_head: bool, tensor_parallel_size: int = 1):
    config = config_from_dict({
        **TINY,
        "model": {**TINY["model"], "family": "albert", "embedding_size": EMBEDDING_SIZE, "sharing": sharing},
        "objective": {"sentence_pairs": "sop" if sentence_order_head else "none"},
        "parallel": {"tensor": tensor_parallel_size},
    })
    validate(config)
    return config


def _inputs() -> dict[str, torch.Tensor]:
    return {key: bert_batch()[key] for key in ("tokens", "token_types", "padding_mask")}


def _export_at(rank: int, tensor_parallel_size: int, out_dir: Path, native_dir: Path) -> dict:
    results = {}
    for name, (sharing, sentence_order_head, _) in MODELS.items():
        config = albert_config(sharing, sentence_order_head, tensor_parallel_size)
        model = build_model(config).eval()
        _load_full_state(model, _perturbed(gather_full_parameters(model)))
        state = gather_full_parameters(model)
        if rank == 0:
            export_dir = out_dir / f"{name}_tp{tensor_parallel_size}"
            albert.export_hf(state, config.model, config.padded_vocab_size, export_dir)
        results[name] = {"state": state, "logits": gather_vocab_shards(model(**_inputs()))}
        if sentence_order_head:
            results[name]["sentence_order_logits"] = model.sentence_order_logits(**_inputs()).detach()
            _load_full_state(model, albert.import_hf(native_dir))
            results[name]["native_logits"] = gather_vocab_shards(model(**_inputs()))
    return results


def _export_and_import(rank: int, world_size: int, out_dir: Path, native_dir: Path) -> dict:
    results = {}
    for tensor_parallel_size in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        results[tensor_parallel_size] = _export_at(rank, tensor_parallel_size, out_dir, native_dir)
        parallel_state.destroy_model_parallel()
    return results


def _native_hf_model(directory: Path) -> Path:
    """An AlbertForPreTraining initialised by `transformers` (then perturbed), saved with save_pretrained."""
    model = TINY["model"]
    torch.manual_seed(0)
    hf_model = AlbertForPreTraining(AlbertConfig(
        vocab_size=512, embedding_size=EMBEDDING_SIZE, hidden_size=model["hidden_size"],
        num_hidden_layers=model["num_layers"], num_attention_heads=model["num_heads"],
        intermediate_size=4 * model["hidden_size"], max_position_embeddings=model["seq_length"], layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    ))
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    hf_model.save_pretrained(directory / "native")
    return directory / "native"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict]]:
    out_dir = tmp_path_factory.mktemp("hf_albert")
    native_dir = _native_hf_model(out_dir)
    return out_dir, native_dir, run_on_ranks(_export_and_import, 2, out_dir, native_dir)[0]


def _hf_outputs(hf_model: torch.nn.Module):
    inputs = _inputs()
    with torch.no_grad():
        return hf_model(input_ids=inputs["tokens"], token_type_ids=inputs["token_types"],
                        attention_mask=inputs["padding_mask"])


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_computes_our_logits(exported, name: str, tensor_parallel_size: int):
    out_dir, _, results = exported
    ours = results[tensor_parallel_size][name]
    hf_class = MODELS[name][2]
    hf_model = hf_class.from_pretrained(out_dir / f"{name}_tp{tensor_parallel_size}").eval()
    assert type(hf_model) is hf_class
    assert hf_model.config.num_hidden_groups == (1 if MODELS[name][0] == "all" else TINY["model"]["num_layers"])
    outputs = _hf_outputs(hf_model)
    logits = outputs.prediction_logits if hf_class is AlbertForPreTraining else outputs.logits
    diff = (logits - ours["logits"]).abs().max().item()
    print(f"{name} TP={tensor_parallel_size}: max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-5
    if "sentence_order_logits" in ours:
        assert (outputs.sop_logits - ours["sentence_order_logits"]).abs().max() <= 1e-5


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_import_inverts_export(exported, name: str, tensor_parallel_size: int):
    out_dir, _, results = exported
    ours = results[tensor_parallel_size][name]["state"]
    imported = albert.import_hf(out_dir / f"{name}_tp{tensor_parallel_size}")
    assert imported.keys() == ours.keys()
    for weight_name, tensor in ours.items():
        assert torch.equal(imported[weight_name], tensor), weight_name


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_hf_initialised_model_imports_and_shards(exported, tensor_parallel_size: int):
    _, native_dir, results = exported
    hf_outputs = _hf_outputs(AlbertForPreTraining.from_pretrained(native_dir).eval())
    diff = (results[tensor_parallel_size]["shared_sop"]["native_logits"] - hf_outputs.prediction_logits).abs().max()
    assert diff <= 1e-5


def test_export_refuses_sublayer_sharing(exported, tmp_path: Path):
    for sharing in ("attention", "ffn"):
        config = albert_config(sharing, sentence_order_head=False)
        with pytest.raises(ValueError, match=f"model.sharing={sharing}: .* export runs trained with model.sharing=all"):
            albert.export_hf({}, config.model, config.padded_vocab_size, tmp_path)


def test_import_refuses_groups_it_cannot_hold(tmp_path: Path):
    hf_config = AlbertConfig(vocab_size=128, embedding_size=8, hidden_size=16, num_hidden_layers=4,
                             num_hidden_groups=2, num_attention_heads=2, intermediate_size=32)
    AlbertForMaskedLM(hf_config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="2 layer groups of 1 layers for 4 layers"):
        albert.import_hf(tmp_path)


@pytest.mark.slow
def test_export_of_a_pipelined_run_matches_transformers(small_dataset: Path, tmp_path: Path):
    """`scaletrain export` of a PP=2 run (the shared block tied across both stages, written once) loads as
    AlbertForPreTraining and computes the run's logits; `scaletrain import` + train.init_from starts a new
    run at the source run's validation loss."""
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train(small_dataset, run_dir, ["parallel.pipeline=2"], nproc=2)
    run_scaletrain("export", [str(run_dir), str(hf_dir)])
    ours_inputs, hf_inputs = bert_inputs("bert")
    ours = run_on_ranks(_our_logits, 1, run_dir, ours_inputs)[0]
    hf_model = AlbertForPreTraining.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        theirs = hf_model(**hf_inputs).prediction_logits
    keep = hf_inputs["attention_mask"].bool()  # padded positions are free to differ
    assert (ours[keep] - theirs[keep]).abs().max().item() <= 1e-4

    weights = tmp_path / "imported.pt"
    run_scaletrain("import", [str(hf_dir), str(weights), "--family", "albert"])
    fresh = tmp_path / "fresh"
    _train(small_dataset, fresh, [f"train.init_from={weights}", "train.steps=1", "train.warmup_steps=0",
                                  "train.eval_every=1"], nproc=1)
    _, source_val = read_metrics(run_dir)
    _, fresh_val = read_metrics(fresh)
    assert abs(fresh_val[0] - source_val[6]) <= 1e-4


def _train(data_dir: Path, run_dir: Path, extra: list[str], nproc: int) -> None:
    overrides = [*tiny_overrides(data_dir, run_dir), "model.ffn_hidden_size=128", "model.embedding_size=32",
                 "train.steps=6", "train.eval_every=6", *extra]
    run_scaletrain("train", [str(REPO / "configs" / "albert_tiny.yaml"), *overrides], nproc)
