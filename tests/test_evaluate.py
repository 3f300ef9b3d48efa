"""`scaletrain eval`: a checkpoint's validation loss, in one process, equals the one its training run
logged at that step, whatever layout trained it; it names the checkpoint it read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

STEPS = 4


def _train(data_dir: Path, run_dir: Path, nproc: int, *layout: str) -> dict[int, float]:
    """A tiny GPT run evaluated and checkpointed at its last step; its logged val_loss by step."""
    overrides = [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", f"train.eval_every={STEPS}",
                 f"checkpoint.every={STEPS}", *layout]
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides], nproc)
    return read_metrics(run_dir)[1]


def _eval(run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(1), "eval", str(run_dir), *options], cwd=REPO, env=scaletrain_environment(),
                          capture_output=True, text=True, timeout=300)


def _printed(stdout: str) -> dict[str, float]:
    """The `name value` lines after the `step N (...)` line."""
    return {name: float(value) for name, value in (line.split() for line in stdout.splitlines()[1:])}


@pytest.mark.slow  # trains a 4-step run (~20 s on 2 cores)
def test_eval_of_a_single_rank_run(small_dataset: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    logged = _train(small_dataset, run_dir, 1)
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"

    result = _eval(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"using checkpoint {checkpoint} (step {STEPS})" in result.stderr
    assert result.stdout.startswith(f"step {STEPS} ({checkpoint}): 16 validation sequences of 32 tokens\n")
    assert _printed(result.stdout)["val_loss"] == pytest.approx(logged[STEPS], abs=1e-5)

    fewer = _eval(run_dir, "--checkpoint", checkpoint.name, "--samples", "8")  # a name under RUN/checkpoints
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert fewer.stdout.startswith(f"step {STEPS} ({checkpoint}): 8 validation sequences")
    assert _printed(fewer.stdout)["val_loss"] != pytest.approx(logged[STEPS], abs=1e-5)

    missing = _eval(run_dir, "--checkpoint", "step_00000099")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "scaletrain eval: error: --checkpoint step_00000099 is not a complete checkpoint" in missing.stderr


@pytest.mark.slow  # trains a 4-step run on 2 ranks (~30 s on 2 cores)
def test_eval_of_a_tensor_parallel_run_in_one_process(small_dataset: Path, tmp_path: Path) -> None:
    """TP=2 trained it; one unsplit model evaluates it: the same loss up to float summation order."""
    run_dir = tmp_path / "run"
    logged = _train(small_dataset, run_dir, 2, "parallel.tensor=2")
    result = _eval(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _printed(result.stdout)["val_loss"] == pytest.approx(logged[STEPS], abs=1e-5)
