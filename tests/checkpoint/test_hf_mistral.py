"""A llama with a sliding window exports as `MistralForCausalLM`: transformers computes our logits (also on
packed documents, which it reads from restarting position_ids), decodes greedily what we decode, and the
export imports back exactly; a GPT with a window has no Hugging Face model type and refuses to export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import MistralForCausalLM

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.data.objectives import document_ids
from scaletrain.data.tokenizer import SPECIAL_IDS
from scaletrain.families import build_model
from scaletrain.families.gpt import hf as gpt_conversion
from scaletrain.families.llama.hf import ADAPTER as LLAMA_ADAPTER
from scaletrain.model.attention_masks import positions_in_document
from scaletrain.model.sampling import sample_tokens
from tests.distributed.harness import run_on_ranks

VOCAB = 400
SEQ = 32
WINDOW = 6


def windowed_config(family: str = "llama"):
    model = {"family": family, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": SEQ,
             "sliding_window": WINDOW, "document_masking": True, "document_positions": True}
    if family == "llama":
        model |= {"num_kv_heads": 2, "ffn_hidden_size": 96, "rope_theta": 500000.0}
    config = config_from_dict({"model": model, "data": {"vocab_size": VOCAB, "num_sentinels": 4},
                               "train": {"seed": 5}})
    validate(config)
    return config


def packed_tokens() -> torch.Tensor:
    tokens = torch.randint(7, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[0, [9, 21]] = SPECIAL_IDS["eos"]
    tokens[1, 0] = SPECIAL_IDS["eos"]
    return tokens


def _ours_and_export(rank: int, world_size: int, out_dir: Path) -> dict:
    """Our windowed llama with large seeded weights (so greedy decoding does not repeat one token): its
    logits plain and packed, its greedy continuation, and its weights exported to out_dir."""
    parallel_state.initialize_model_parallel()
    config = windowed_config()
    model = build_model(config).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
        tokens = packed_tokens()
        state = {name: param.detach().clone() for name, param in model.named_parameters()}
        LLAMA_ADAPTER.export(state, config, out_dir)
        prompt = tokens[1, :5].tolist()
        return {
            "state": state,
            "plain": model(tokens),
            "packed": model(tokens, document_ids=document_ids(tokens, SPECIAL_IDS["eos"])),
            "greedy": sample_tokens(model, prompt, SEQ - 5, SEQ, VOCAB, 0.0, None, torch.Generator()),
            "prompt": prompt,
        }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("mistral")
    return out_dir, run_on_ranks(_ours_and_export, 1, out_dir)[0]


def test_the_export_is_a_mistral_with_our_window(exported):
    out_dir, _ = exported
    hf_config = json.loads((out_dir / "config.json").read_text())
    assert hf_config["model_type"] == "mistral" and hf_config["architectures"] == ["MistralForCausalLM"]
    assert hf_config["sliding_window"] == WINDOW and hf_config["num_key_value_heads"] == 2
    assert hf_config["rope_parameters"]["rope_theta"] == 500000.0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_transformers_computes_our_logits(exported, attention: str):
    """Plain sequences, and packed ones: transformers masks documents where position_ids restart (only
    without a cache, masking_utils._preprocess_mask_arguments, so use_cache=False)."""
    out_dir, ours = exported
    hf = MistralForCausalLM.from_pretrained(out_dir, attn_implementation=attention).eval()
    tokens = packed_tokens()
    positions = positions_in_document(document_ids(tokens, SPECIAL_IDS["eos"]))
    with torch.no_grad():
        plain = hf(input_ids=tokens).logits
        packed = hf(input_ids=tokens, position_ids=positions, use_cache=False).logits
    assert ours["plain"].std() > 0.5
    assert (plain - ours["plain"]).abs().max() <= 1e-4
    assert (packed - ours["packed"]).abs().max() <= 1e-4
    assert (ours["packed"] - ours["plain"]).abs().max() > 1e-2  # the documents made a difference


def test_transformers_decodes_greedily_what_we_decode(exported):
    """transformers' generate behind its sliding-window cache, and our sampler behind ours; 27 new tokens
    slide a window of 6 many times over."""
    out_dir, ours = exported
    hf = MistralForCausalLM.from_pretrained(out_dir).eval()
    hf.generation_config.eos_token_id = None  # decode the full length, as ours does without a stop token
    padding_rows = list(range(VOCAB, hf.config.vocab_size))  # our sampler never picks the vocabulary's padding
    with torch.no_grad():
        generated = hf.generate(torch.tensor([ours["prompt"]]), max_new_tokens=SEQ - 5, do_sample=False,
                                suppress_tokens=padding_rows, pad_token_id=SPECIAL_IDS["pad"])
    theirs = generated[0, len(ours["prompt"]):].tolist()
    assert theirs == ours["greedy"]
    assert len(set(theirs)) > 3


def test_import_inverts_the_export(exported):
    out_dir, ours = exported
    imported = LLAMA_ADAPTER.import_(out_dir)
    assert imported.keys() == ours["state"].keys()
    for name, weight in ours["state"].items():
        assert torch.equal(imported[name], weight), name


def _gpt_state(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    return dict(build_model(windowed_config("gpt")).named_parameters())


def test_a_gpt_with_a_window_refuses_to_export(tmp_path: Path):
    config = windowed_config("gpt")
    state = run_on_ranks(_gpt_state, 1)[0]
    with pytest.raises(ValueError, match=r"sliding window \(model.sliding_window=6\), which GPT2LMHeadModel cannot"):
        gpt_conversion.ADAPTER.export(state, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
