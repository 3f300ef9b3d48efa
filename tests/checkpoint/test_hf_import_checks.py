"""`scaletrain import` refuses a broken Hugging Face directory in one line, exit 2, writing nothing at the
out path (checkpoint/hf/reading.py): each case below is a tiny saved GPT2LMHeadModel with one thing broken."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from scaletrain.cli import main
from scaletrain.families.gpt.hf import import_hf

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=2, eos_token_id=3))
    hf_dir = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(hf_dir)
    return hf_dir


def _edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(hf_dir: Path) -> None:
        weights = load_file(hf_dir / WEIGHTS)
        edit(weights)
        save_file(weights, hf_dir / WEIGHTS, metadata={"format": "pt"})
    return apply


def _set_config(key: str, value: object) -> Callable[[Path], None]:
    def apply(hf_dir: Path) -> None:
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, key: value}))
    return apply


def _poison(name: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda weights: weights[name].view(-1).__setitem__(slice(0, 2), value)


def _truncate(hf_dir: Path) -> None:
    (hf_dir / WEIGHTS).write_bytes((hf_dir / WEIGHTS).read_bytes()[:5000])


BROKEN = {
    "missing tensor": (_edit_weights(lambda weights: weights.pop("transformer.h.1.mlp.c_fc.weight")),
                       "has no tensor transformer.h.1.mlp.c_fc.weight, which a GPT2LMHeadModel with its config.json "
                       "needs"),
    "negative layer count": (_set_config("n_layer", -1), "config.json has n_layer=-1; it must be a whole number >= 1"),
    "layer count as a string": (_set_config("n_layer", "2"), "config.json has n_layer='2'; it must be a whole number"),
    "zero width": (_set_config("n_embd", 0), "config.json has n_embd=0"),
    "no config.json": (lambda hf_dir: (hf_dir / "config.json").unlink(), "config.json does not exist"),
    "config.json not JSON": (lambda hf_dir: (hf_dir / "config.json").write_text("{n_layer: 2"),
                             "config.json is not valid JSON"),
    "no weights": (lambda hf_dir: (hf_dir / WEIGHTS).unlink(), "holds no model.safetensors or pytorch_model.bin"),
    "truncated safetensors": (_truncate, "model.safetensors is not a readable safetensors file"),
    "wrong shape": (_edit_weights(lambda weights: weights.__setitem__("transformer.h.0.mlp.c_fc.weight",
                                                                      torch.zeros(16, 60))),
                    "transformer.h.0.mlp.c_fc.weight has shape [16, 60], but its config.json makes it [16, 64]"),
    "a layer more than config.json counts": (
        _edit_weights(lambda weights: weights.__setitem__("transformer.h.2.ln_1.weight", torch.ones(16))),
        "holds transformer.h.2.ln_1.weight, of more layers (or experts) than its config.json counts"),
    "integer weight": (_edit_weights(lambda weights: weights.__setitem__("transformer.h.0.mlp.c_fc.bias",
                                                                         torch.zeros(64, dtype=torch.int32))),
                       "stores transformer.h.0.mlp.c_fc.bias as I32; model weights are floating point"),
    "NaN weights": (_edit_weights(_poison("transformer.h.0.attn.c_attn.weight", float("nan"))),
                    "holds non-finite values: transformer.h.0.attn.c_attn.weight (2 of 768 values)"),
    "infinite weights": (_edit_weights(_poison("transformer.ln_f.bias", float("inf"))),
                         "holds non-finite values: transformer.ln_f.bias (2 of 16 values)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_hf_directory_is_refused_in_one_line_and_nothing_is_written(
    saved_gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture, case: str
):
    break_it, message = BROKEN[case]
    hf_dir, out_file = tmp_path / "broken", tmp_path / "weights.pt"
    shutil.copytree(saved_gpt2, hf_dir)
    break_it(hf_dir)
    assert main(["import", str(hf_dir), str(out_file), "--family", "gpt"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"scaletrain import: error: {hf_dir}"), errors
    assert message in errors[0], errors[0]
    assert list(tmp_path.glob("weights.pt*")) == []


def test_hub_names_buffers_and_a_head_the_class_lacks_still_import(saved_gpt2: Path, tmp_path: Path):
    """The GPT-2 checkpoints on the Hub name weights without the `transformer.` prefix and keep the
    attention mask buffers; a left-over head of another class is dropped, as transformers does."""
    weights = load_file(saved_gpt2 / WEIGHTS)
    hub_style = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    hub_style |= {f"h.{layer}.attn.bias": torch.ones(1, 1, 16, 16) for layer in range(2)}
    hub_style["multiple_choice_head.summary.weight"] = torch.ones(1, 16)
    hf_dir = tmp_path / "hub_style"
    shutil.copytree(saved_gpt2, hf_dir)
    save_file(hub_style, hf_dir / WEIGHTS, metadata={"format": "pt"})
    imported, reference = import_hf(hf_dir), import_hf(saved_gpt2)
    assert imported.keys() == reference.keys()
    assert all(torch.equal(imported[name], reference[name]) for name in reference)
