"""`scaletrain import --family t5` refuses a config.json that leaves out a size it reads in one line naming
the key, exit 2, writing nothing (families/t5/hf.py; it used to end in a KeyError traceback). The other
checks of a broken directory are the same for every family: tests/checkpoint/test_hf_import_checks.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from scaletrain.cli import main
from scaletrain.families.t5.hf import REQUIRED_KEYS, import_hf


@pytest.fixture(scope="module")
def saved_t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=4, decoder_start_token_id=0))
    hf_dir = tmp_path_factory.mktemp("hf") / "t5"
    model.save_pretrained(hf_dir)
    return hf_dir


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_a_config_without_a_size_is_refused_naming_it(saved_t5: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture, key: str):
    hf_dir, out_file = tmp_path / "broken", tmp_path / "weights.pt"
    shutil.copytree(saved_t5, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    del config[key]
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert main(["import", str(hf_dir), str(out_file), "--family", "t5"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"scaletrain import: error: {hf_dir / 'config.json'} sets no {key}; a T5 config.json sets "
                      "vocab_size, d_model, num_heads, d_kv, d_ff, num_layers (as save_pretrained writes them): "
                      "download it again, or save the model again with save_pretrained"], errors
    assert list(tmp_path.glob("weights.pt*")) == []


def test_the_whole_config_imports(saved_t5: Path):
    assert import_hf(saved_t5)["embedding.weight"].shape == (64, 16)
