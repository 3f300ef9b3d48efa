"""A crafted checkpoint file must not run code: resume, generate, export and import read every file
with torch's restricted unpickler and refuse what is not tensors and plain data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.integrity import seal_meta
from tests.train.runs import DEMO_CONFIG, REPO, launcher, run_scaletrain, scaletrain_environment, tiny_overrides


class RunsCode:
    """Unpickling this runs a shell command: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft(path: Path, marker: Path) -> None:
    """Replace a checkpoint file by one that carries code, with meta.json's size record updated
    to match and resealed, as a deliberate attacker would."""
    torch.save({"module": {"weight": torch.zeros(2)}, "payload": RunsCode(marker)}, path)
    step_dir = path.parents[1]  # step_XXXXXXXX/{rng,state}/file
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"][str(path.relative_to(step_dir))] = path.stat().st_size
    (step_dir / "meta.json").write_text(json.dumps(seal_meta(meta)))


@pytest.fixture(scope="module")
def trained(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.steps=4",
                             "train.eval_every=0", "checkpoint.keep_last=1", "train.exit_after=2"], stopped_early=True)
    return run_dir


def scaletrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(1), *args], cwd=REPO, env=scaletrain_environment(), capture_output=True,
                          text=True, timeout=600)


def assert_refused(result: subprocess.CompletedProcess, file: Path, marker: Path) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "holds objects that a checkpoint must not contain" in result.stderr and str(file) in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists(), "the crafted file ran its code"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rng/rank_00000.pt", "model/rank_00000.pt"])
def test_resume_refuses_a_crafted_file(target: str, trained: Path, small_dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    file = run_dir / "checkpoints" / "step_00000002" / target
    marker = tmp_path / "pwned"
    craft(file, marker)
    result = scaletrain("train", str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.steps=4",
                        "train.eval_every=0")
    assert_refused(result, file, marker)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "export"])
def test_generate_and_export_refuse_a_crafted_file(command: str, trained: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    file = run_dir / "checkpoints" / "step_00000002" / "model" / "rank_00000.pt"
    marker = tmp_path / "pwned"
    craft(file, marker)
    args = [str(run_dir), "--max-new-tokens", "2"] if command == "generate" else [str(run_dir), str(tmp_path / "hf")]
    assert_refused(scaletrain(command, *args), file, marker)
    assert not (tmp_path / "hf").exists()


def test_import_refuses_a_crafted_pytorch_model_bin(tmp_path: Path):
    from transformers import GPT2Config

    hf_dir = tmp_path / "hf"
    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16).save_pretrained(hf_dir)
    marker = tmp_path / "pwned"
    torch.save({"payload": RunsCode(marker)}, hf_dir / "pytorch_model.bin")
    result = scaletrain("import", str(hf_dir), str(tmp_path / "weights.pt"), "--family", "gpt")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "pytorch_model.bin" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists(), "the crafted file ran its code"
    assert not (tmp_path / "weights.pt").exists()
