"""A start that fails before its first step leaves the run directory as it found it (train/run_lock.py
RunDirectoryStart), and says why in one line: a missing or non-finite train.init_from here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from tests.train.runs import DEMO_CONFIG, REPO, launcher, scaletrain_environment, tiny_overrides


def _refusal(args: list[str]) -> list[str]:
    result = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *args], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors


def test_a_failed_start_names_init_from_and_leaves_no_run_directory_behind(small_dataset: Path, tmp_path: Path):
    missing, fresh_run = tmp_path / "missing.pt", tmp_path / "fresh_run"
    errors = _refusal([*tiny_overrides(small_dataset, fresh_run), f"train.init_from={missing}"])
    assert errors[0].startswith(f"scaletrain train: error: train.init_from={missing} does not exist; give the file "
                                "`scaletrain import"), errors
    assert not fresh_run.exists()

    nonfinite = tmp_path / "nan.pt"
    torch.save({"embedding.word.weight": torch.tensor([[1.0, float("nan")]])}, nonfinite)
    errors = _refusal([*tiny_overrides(small_dataset, fresh_run), f"train.init_from={nonfinite}"])
    assert "holds non-finite values: embedding.word.weight (1 of 2 values)" in errors[0], errors
    assert not fresh_run.exists(), "the directory the start made is taken back"

    existing_run = tmp_path / "existing_run"
    existing_run.mkdir()
    (existing_run / "notes.txt").write_text("mine")
    _refusal([*tiny_overrides(small_dataset, existing_run), f"train.init_from={nonfinite}"])
    assert [path.name for path in existing_run.iterdir()] == ["notes.txt"], "only what the start made is taken back"
