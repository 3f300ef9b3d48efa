"""BART export to Hugging Face: `BartForConditionalGeneration` computes our logits and decodes our
greedy tokens; import inverts export; `scaletrain generate` on a run says what HF's greedy export says."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import AutoTokenizer, BartForConditionalGeneration

from scaletrain.families.bart.hf import export_hf, import_hf, read_bart_architecture
from scaletrain.families.bart.model import BART
from scaletrain.model.sampling import sample_seq2seq
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks
from tests.model.test_bart import ARCHITECTURE, EOS, SEED, bart_batch
from tests.model.test_t5 import mp_config
from tests.train.runs import REPO, run_scaletrain, tiny_overrides

LAYOUTS = (1, 2)  # tensor-parallel sizes
# Larger weights than the 0.02 init, so greedy decoding does not repeat one token from the start.
DECODING = replace(ARCHITECTURE, init_std=0.1)
PROMPT = [*torch.randint(7, 390, (6,), generator=torch.Generator().manual_seed(0)).tolist(), EOS]
NEW_TOKENS = 12


def _build_and_export(rank: int, world_size: int, out_root: str) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    batch = bart_batch()
    model = BART(ARCHITECTURE, mp_config(world_size), seed=SEED)
    merged = gather_full_parameters(model)
    with torch.no_grad():
        logits = gather_vocab_shards(model(**{k: v for k, v in batch.items() if k != "labels"}))
        loss = model(**batch)
    if rank == 0:
        export_hf(merged, ARCHITECTURE, Path(out_root) / f"tp{world_size}")
    result = {"weights": merged, "logits": logits, "loss": loss}
    if world_size == 1:
        decoding = BART(DECODING, mp_config(1), seed=SEED).eval()
        export_hf(gather_full_parameters(decoding), DECODING, Path(out_root) / "decoding")
        result["greedy"] = sample_seq2seq(decoding, PROMPT, NEW_TOKENS, ARCHITECTURE.vocab_size, 0.0, None,
                                          torch.Generator(), start_token=EOS, stop_token=EOS)
    return result


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    out_root = tmp_path_factory.mktemp("hf_bart")
    return out_root, {world: run_on_ranks(_build_and_export, world, str(out_root))[0] for world in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("world", LAYOUTS)
def test_hugging_face_computes_our_logits(exported: tuple[Path, dict], world: int):
    out_root, results = exported
    model = BartForConditionalGeneration.from_pretrained(out_root / f"tp{world}", attn_implementation="eager").eval()
    batch = bart_batch()
    with torch.no_grad():
        output = model(input_ids=batch["encoder_tokens"], attention_mask=batch["encoder_padding_mask"],
                       decoder_input_ids=batch["decoder_tokens"], decoder_attention_mask=batch["decoder_padding_mask"],
                       labels=batch["labels"])
    ours = results[world]
    assert output.logits.shape == ours["logits"].shape
    assert (output.logits - ours["logits"]).abs().max() <= 1e-5
    assert abs(output.loss.item() - ours["loss"].item()) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", LAYOUTS)
def test_import_inverts_export(exported: tuple[Path, dict], world: int):
    out_root, results = exported
    hf_dir = out_root / f"tp{world}"
    assert read_bart_architecture(hf_dir) == ARCHITECTURE
    imported, original = import_hf(hf_dir), results[world]["weights"]
    assert imported.keys() == original.keys()
    for name, weight in original.items():
        assert torch.equal(imported[name], weight), f"{name} changed in the round trip"


@pytest.mark.slow
def test_hugging_face_greedy_decoding_is_ours(exported: tuple[Path, dict]):
    """HF's generate starts from the export's decoder_start_token_id (eos) and stops at eos, as we do."""
    out_root, results = exported
    model = BartForConditionalGeneration.from_pretrained(out_root / "decoding").eval()
    generated = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    assert generated[0, 0].item() == EOS
    assert generated[0, 1:].tolist() == results[1]["greedy"]
    assert len(set(results[1]["greedy"])) > 1


@pytest.mark.slow
def test_export_refuses_what_hugging_face_cannot_hold(exported: tuple[Path, dict], tmp_path: Path):
    weights = exported[1][1]["weights"]
    with pytest.raises(ValueError, match="layernorm_eps=1e-06, but HF's BART LayerNorms use 1e-05"):
        export_hf(weights, replace(ARCHITECTURE, layernorm_eps=1e-6), tmp_path)
    with pytest.raises(ValueError, match="no weight decoder.layers.3"):
        export_hf(weights, replace(ARCHITECTURE, num_decoder_layers=4), tmp_path)


@pytest.mark.slow  # trains a 4-step BART run (~1 min on 2 cores)
def test_scaletrain_generate_says_what_the_export_decodes(small_dataset: Path, tmp_path: Path):
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    run_scaletrain("train", [str(REPO / "configs" / "bart_tiny.yaml"), *tiny_overrides(small_dataset, run_dir),
                             "model.ffn_hidden_size=128", "train.steps=4", "train.eval_every=4"])
    run_scaletrain("export", [str(run_dir), str(hf_dir)])
    prompt = "Now is the winter of our discontent"
    stdout = run_scaletrain("generate", [str(run_dir), "--prompt", prompt, "--temperature", "0",
                                         "--max-new-tokens", str(NEW_TOKENS)], timeout=300)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = BartForConditionalGeneration.from_pretrained(hf_dir).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs.input_ids[0, -1].item() == EOS  # framed as the encoder saw text in training
    generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    expected = prompt + tokenizer.decode(generated[0, 1:], skip_special_tokens=True)
    assert stdout.rstrip("\n").endswith(expected)
