"""Non-finite losses (issue 9): the step is skipped on every rank without touching weights or Adam
state, counted, and the run goes on; too many in a row stop it, keeping the last good checkpoint.
The fault is injected with train.inject_nonfinite_loss_at, on the first data-parallel rank only."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scaletrain.train.nonfinite import weights_are_finite
from tests.distributed.harness import run_on_ranks
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

STEPS = 6
SKIPPED = 4  # the step whose loss is made NaN
GLOBAL_BATCH = 8  # tiny_overrides

LAYOUTS = {  # ZeRO-0 and the pipeline engine have no overflow check of their own; ZeRO-1 has one
    "zero0": (1, ["parallel.zero_stage=0"]),
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "pp2_zero0": (2, ["parallel.pipeline=2", "parallel.zero_stage=0"]),
}


@pytest.fixture(scope="module")
def injected_runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The run of a layout with a NaN loss at step SKIPPED, trained once per module."""
    runs: dict[str, Path] = {}

    def run(layout: str) -> Path:
        if layout not in runs:
            nproc, extra = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(layout) / "run"
            run_scaletrain("train", [str(DEMO_CONFIG), *overrides(
                small_dataset, run_dir, *extra, f"train.inject_nonfinite_loss_at=[{SKIPPED}]")], nproc=nproc)
            runs[layout] = run_dir
        return runs[layout]

    return run


def overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=0",
            "checkpoint.every=1", f"checkpoint.keep_last={STEPS}", *extra]


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a checkpoint's DeepSpeed files (weights, Adam moments and step counts), by
    file and key path; DeepSpeed's own counters (global_steps...) are plain ints and left out."""
    tensors: dict[str, torch.Tensor] = {}

    def collect(value: object, key: str) -> None:
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            for name, item in value.items():
                collect(item, f"{key}/{name}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                collect(item, f"{key}/{index}")

    for file in sorted((path / "state").glob("*.pt")):
        collect(torch.load(file, map_location="cpu", weights_only=False), file.name)
    return tensors


def same_tensors(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_non_finite_loss_skips_the_update_on_every_rank(layout: str, injected_runs: Callable[[str], Path]):
    run_dir = injected_runs(layout)
    training, _ = read_metrics(run_dir)
    assert training[SKIPPED]["loss"] is None, "the NaN loss is logged (as JSON null)"
    assert [training[step]["skipped_steps"] for step in range(1, STEPS + 1)] == [0, 0, 0, 1, 1, 1]
    assert all(training[step]["loss"] is not None for step in range(1, STEPS + 1) if step != SKIPPED)
    before, skipped = saved_tensors(checkpoint(run_dir, SKIPPED - 1)), saved_tensors(checkpoint(run_dir, SKIPPED))
    assert same_tensors(before, skipped), "weights and optimizer state are untouched by the skipped step"
    assert not same_tensors(saved_tensors(checkpoint(run_dir, SKIPPED - 2)), before), "a normal step changes them"
    meta = json.loads((checkpoint(run_dir, SKIPPED) / "meta.json").read_text())
    assert meta["consumed_samples"] == SKIPPED * GLOBAL_BATCH, "the skipped step consumed its batch"
    assert meta["skipped_steps"] == 1 and meta["consecutive_skipped_steps"] == 1


@pytest.mark.slow
def test_after_a_skip_training_goes_on_from_the_weights_before_it(
    injected_runs: Callable[[str], Path], small_dataset: Path, tmp_path: Path
):
    """Reference: the checkpoint before the skip, resumed one batch later (as if step 4 had trained on
    nothing): its losses at steps 5 and 6 equal the run's with the skip, bit for bit."""
    run_dir, reference_dir = injected_runs("zero0"), tmp_path / "reference"
    resumed_at = reference_dir / "checkpoints" / f"step_{SKIPPED:08d}"
    shutil.copytree(checkpoint(run_dir, SKIPPED - 1), resumed_at)
    meta = json.loads((resumed_at / "meta.json").read_text())
    meta.update(step=SKIPPED, consumed_samples=SKIPPED * GLOBAL_BATCH)
    (resumed_at / "meta.json").write_text(json.dumps(meta))
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, reference_dir, "parallel.zero_stage=0")])
    training, _ = read_metrics(run_dir)
    reference, _ = read_metrics(reference_dir)
    assert sorted(reference) == [5, 6]
    assert [training[step]["loss"] for step in (5, 6)] == [reference[step]["loss"] for step in (5, 6)]


@pytest.mark.slow
def test_consecutive_skips_stop_the_run_and_keep_the_last_good_checkpoint(small_dataset: Path, tmp_path: Path):
    """Steps 4-6 non-finite with train.max_skipped_steps=3: the run stops at step 6 with exit code 3,
    before that step's checkpoint, naming the checkpoint of step 3, which is still there (keep_last=1)."""
    run_dir = tmp_path / "run"
    args = overrides(small_dataset, run_dir, "parallel.zero_stage=0", "train.steps=20", "checkpoint.every=3",
                     "checkpoint.keep_last=1", "train.max_skipped_steps=3", "train.inject_nonfinite_loss_at=[4,5,6]")
    result = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *args], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert ("training diverged: the loss or gradient norm was non-finite at 3 steps in a row (steps 4-6, "
            "train.max_skipped_steps=3)") in result.stderr
    assert f"The last good checkpoint is {checkpoint(run_dir, 3)}" in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000003"]
    training, _ = read_metrics(run_dir)
    assert sorted(training) == [1, 2, 3, 4, 5, 6]
    assert [training[step]["loss"] is None for step in range(1, 7)] == [False, False, False, True, True, True]
    assert training[6]["skipped_steps"] == 3


def check_weights_on_ranks(rank: int, world_size: int) -> tuple[bool, bool]:
    """(finite before, finite after) rank 1 gets an infinite bias."""
    module = torch.nn.Linear(4, 4)
    before = weights_are_finite(module, torch.device("cpu"))
    if rank == 1:
        with torch.no_grad():
            module.bias[1] = float("inf")
    return before, weights_are_finite(module, torch.device("cpu"))


@pytest.mark.slow
def test_every_rank_sees_non_finite_weights_on_any_rank():
    """The check before each checkpoint: one rank's infinite weight stops the save on both."""
    assert run_on_ranks(check_weights_on_ranks, 2) == [(True, False), (True, False)]
