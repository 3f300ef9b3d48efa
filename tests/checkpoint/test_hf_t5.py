"""T5 export to Hugging Face: `T5ForConditionalGeneration` computes our logits; import inverts export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import T5ForConditionalGeneration

from scaletrain.families.t5.hf import export_hf as export_t5_hf
from scaletrain.families.t5.hf import import_hf as import_t5_hf
from scaletrain.families.t5.hf import read_t5_architecture
from scaletrain.families.t5.model import T5
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks
from tests.model.test_t5 import SEED, VARIANTS, mp_config, t5_batch

LAYOUTS = (1, 2)  # tensor-parallel sizes


def _build_and_export(rank: int, world_size: int, out_root: str) -> dict:
    """Every rank builds its shards; rank 0 exports the merged weights, as a converter would."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    batch = t5_batch()
    results = {}
    for variant, architecture in VARIANTS.items():
        model = T5(architecture, mp_config(world_size), seed=SEED)
        merged = gather_full_parameters(model)
        with torch.no_grad():
            logits = gather_vocab_shards(model(**{k: v for k, v in batch.items() if k != "labels"}))
            loss = model(**batch)
        if rank == 0:
            export_t5_hf(merged, architecture, Path(out_root) / f"{variant}_tp{world_size}")
        results[variant] = {"weights": merged, "logits": logits, "loss": loss}
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    out_root = tmp_path_factory.mktemp("hf_t5")
    return out_root, {world: run_on_ranks(_build_and_export, world, str(out_root))[0] for world in LAYOUTS}


def _hf_outputs(hf_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    model = T5ForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="eager").eval()
    batch = t5_batch()
    with torch.no_grad():
        output = model(
            input_ids=batch["encoder_tokens"], attention_mask=batch["encoder_padding_mask"],
            decoder_input_ids=batch["decoder_tokens"], decoder_attention_mask=batch["decoder_padding_mask"],
            labels=batch["labels"],
        )
    return output.logits, output.loss


@pytest.mark.slow
@pytest.mark.parametrize("world", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_hugging_face_computes_our_logits(exported: tuple[Path, dict], variant: str, world: int):
    out_root, results = exported
    ours = results[world][variant]
    logits, loss = _hf_outputs(out_root / f"{variant}_tp{world}")
    assert logits.shape == ours["logits"].shape
    assert (logits - ours["logits"]).abs().max() <= 1e-4
    assert abs(loss.item() - ours["loss"].item()) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("world", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_import_inverts_export(exported: tuple[Path, dict], variant: str, world: int):
    out_root, results = exported
    hf_dir = out_root / f"{variant}_tp{world}"
    assert read_t5_architecture(hf_dir) == VARIANTS[variant]
    imported, original = import_t5_hf(hf_dir), results[world][variant]["weights"]
    assert imported.keys() == original.keys()
    for name, weight in original.items():
        assert torch.equal(imported[name], weight), f"{name} changed in the round trip"


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_imports_what_hugging_face_saves(exported: tuple[Path, dict], variant: str, tmp_path: Path):
    """transformers >= 5 rewrites the tying flags on save; the weights must still come back."""
    out_root, results = exported
    T5ForConditionalGeneration.from_pretrained(out_root / f"{variant}_tp1").save_pretrained(tmp_path)
    assert read_t5_architecture(tmp_path) == VARIANTS[variant]
    imported = import_t5_hf(tmp_path)
    for name, weight in results[1][variant]["weights"].items():
        assert torch.equal(imported[name], weight), f"{name} changed through save_pretrained"


@pytest.mark.slow
def test_export_rejects_weights_of_another_architecture(exported: tuple[Path, dict], tmp_path: Path):
    gated_weights = exported[1][1]["gated_gelu_untied"]["weights"]
    with pytest.raises(ValueError, match="unexpected .'decoder.layers.2"):
        export_t5_hf(gated_weights, VARIANTS["relu_tied"], tmp_path)
