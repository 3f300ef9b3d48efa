"""Non-finite losses (issue 9): the step is skipped on every rank without touching weights or Adam
state, counted, and the run goes on; too many in a row stop it, keeping the last good checkpoint.
The fault is injected with train.inject_nonfinite_loss_at, on the first data-parallel rank only."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.integrity import seal_meta
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
    """Every tensor in a checkpoint's state files (weights and Adam moments), by file and key path, and
    Adam's step count from its index."""
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

    for file in sorted((path / "model").glob("*.pt")):
        collect(torch.load(file, map_location="cpu", weights_only=False), file.name)
    tensors["adam_step"] = torch.tensor(json.loads((path / "model" / "index.json").read_text())["adam_step"])
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
    (resumed_at / "meta.json").write_text(json.dumps(seal_meta(meta)))
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, reference_dir, "parallel.zero_stage=0")])
    training, _ = read_metrics(run_dir)
    reference, _ = read_metrics(reference_dir)
    assert sorted(reference) == [5, 6]
    assert [training[step]["loss"] for step in (5, 6)] == [reference[step]["loss"] for step in (5, 6)]


@pytest.mark.slow
def test_consecutive_skips_stop_the_run_and_set_aside_the_checkpoint_before_them(small_dataset: Path, tmp_path: Path):
    """Steps 5-7 non-finite with train.max_skipped_steps=3: the run stops at step 7 with exit code 3. The
    checkpoint of step 4 holds the weights whose next step failed (the update of step 4 may be what
    blew up), and so does step 6's, written during the streak: both are moved to checkpoints/diverged/;
    pruning kept step 2 although keep_last=1, as no step after it trained finitely; the message names it."""
    run_dir = tmp_path / "run"
    args = overrides(small_dataset, run_dir, "parallel.zero_stage=0", "train.steps=20", "checkpoint.every=2",
                     "checkpoint.keep_last=1", "train.max_skipped_steps=3", "train.inject_nonfinite_loss_at=[5,6,7]")
    result = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *args], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert ("training diverged: the loss or gradient norm was non-finite at 3 steps in a row (steps 5-7, "
            "train.max_skipped_steps=3)") in result.stderr
    assert (f"The update of step 4 blew up the weights; checkpoints from it on were moved to "
            f"{run_dir / 'checkpoints' / 'diverged'} (step_00000004, step_00000006)") in result.stderr
    assert f"The last good checkpoint is {checkpoint(run_dir, 2)}" in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"
    aside = sorted(p.name for p in (run_dir / "checkpoints" / "diverged").iterdir())
    assert aside == ["step_00000004", "step_00000006"]
    training, _ = read_metrics(run_dir)
    assert sorted(training) == list(range(1, 8))
    assert [training[step]["loss"] is None for step in range(1, 8)] == [False] * 4 + [True] * 3
    assert training[7]["skipped_steps"] == 3


@pytest.mark.slow
def test_a_real_divergence_resumes_with_a_lower_lr_from_before_the_blow_up(small_dataset: Path, tmp_path: Path):
    """The probe of issue 20: six good steps, then train.lr=1e4 blows the weights up (a huge but
    finite loss, infinite gradients, every update skipped) and the run exits 3 naming a checkpoint from
    before the blow-up; running again with the LR lowered, as the message says, resumes there and
    trains finite losses to the end (it used to resume the blown-up weights and exit 3 again)."""
    run_dir = tmp_path / "run"

    def train(lr: str, *extra: str) -> subprocess.CompletedProcess:
        args = overrides(small_dataset, run_dir, "parallel.zero_stage=0", "train.steps=24", "checkpoint.every=1",
                         "checkpoint.keep_last=1", f"train.lr={lr}", "train.min_lr=0", *extra)
        return subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *args], cwd=REPO,
                              env=scaletrain_environment(), capture_output=True, text=True, timeout=300)

    assert train("3e-3", "train.exit_after=6").returncode == 75
    diverged = train("1e4")
    assert diverged.returncode == 3, diverged.stderr[-3000:]
    named = re.search(r"The last good checkpoint is (\S+step_(\d+)):", diverged.stderr)
    first_skipped, stopped = map(int, re.search(r"in a row \(steps (\d+)-(\d+),", diverged.stderr).groups())
    assert named and int(named.group(2)) < first_skipped - 1, diverged.stderr[-2000:]
    kept = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    aside = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints" / "diverged").glob("step_*"))
    assert kept == [int(named.group(2))] and aside == list(range(first_skipped - 1, stopped))
    resumed = train("3e-3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {int(named.group(2))} from {named.group(1)}" in resumed.stderr
    training, _ = read_metrics(run_dir)
    assert sorted(training) == list(range(1, 25))
    assert all(training[step]["loss"] is not None and training[step]["loss"] < 10 for step in training)


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


def check_zero3_padding(rank: int, world_size: int) -> tuple[bool, bool]:
    """(finite with NaN in the padding, finite with NaN in a real element) of a ZeRO-3 engine whose 5-element
    bias the 2 ranks do not divide: rank 1's partition is [bias[3], bias[4], padding]."""
    import deepspeed

    from scaletrain import upstream

    module = torch.nn.Linear(4, 5)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(module.parameters()), config=config)
    bias = engine.module.bias
    padding = bias.ds_tensor.numel() - upstream.local_partition(bias).numel()
    assert padding == (1 if rank == 1 else 0)
    if rank == 1:
        bias.ds_tensor[-1] = float("nan")  # what torch.empty may leave there
    with_nan_padding = weights_are_finite(engine.module, torch.device("cpu"))
    if rank == 1:
        bias.ds_tensor[0] = float("nan")
    return with_nan_padding, weights_are_finite(engine.module, torch.device("cpu"))


@pytest.mark.slow
def test_zero3_partition_padding_is_not_taken_for_a_weight():
    """DeepSpeed never writes a ZeRO-3 partition's padding (torch.empty): garbage there is no divergence,
    a NaN in a real element is."""
    assert run_on_ranks(check_zero3_padding, 2) == [(True, False), (True, False)]
