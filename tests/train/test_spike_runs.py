"""Loss spikes in real runs (issue 37, train/spikes.py): a finite blow-up stops with one line, a bad batch
is skipped as if it were not there, every layout decides alike, and a run of spikes rewinds reproducibly.
Spikes are injected with train.spike.inject_at (a global batch's losses x inject_factor on the first
data-parallel rank only)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from scaletrain.train.nonfinite import EXIT_DIVERGED
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

pytestmark = pytest.mark.slow

STEPS = 12
SPIKE = 6  # the global batch whose loss is made a spike

RUNS = {  # name -> (ranks, overrides)
    "spike": (1, [f"train.spike.inject_at=[{SPIKE}]"]),
    "dropped": (1, [f"train.inject_nonfinite_loss_at=[{SPIKE}]"]),  # the same step's update dropped another way
    "dp2": (2, [f"train.spike.inject_at=[{SPIKE}]"]),
    "tp2": (2, [f"train.spike.inject_at=[{SPIKE}]", "parallel.tensor=2"]),
}


def overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=0", "checkpoint.every=4",
            *extra]


@pytest.fixture(scope="module")
def trained(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[int, dict]]:
    """A run's training records by step, each run trained once per module."""
    records: dict[str, dict[int, dict]] = {}

    def run(name: str) -> dict[int, dict]:
        if name not in records:
            nproc, extra = RUNS[name]
            run_dir = tmp_path_factory.mktemp(name) / "run"
            run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir, *extra)], nproc=nproc)
            records[name] = read_metrics(run_dir)[0]
        return records[name]

    return run


def test_a_finite_blow_up_stops_with_one_line_and_sets_its_checkpoints_aside(small_dataset: Path, tmp_path: Path):
    """train.lr=30 took the tiny GPT's loss from 9 to 1e8 with every number finite, and the run ended
    `finished` with exit 0 and garbage weights; now the first spiking steps are skipped and the run stops."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*launcher(1), "train", str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.lr=30",
         "train.warmup_steps=30", "train.steps=30", "train.eval_every=0", "checkpoint.every=3"],
        cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_DIVERGED, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "training diverged: the loss stayed above its trailing window for 8 steps in a row" in last, last
    assert "Traceback" not in result.stderr
    training, _ = read_metrics(run_dir)
    assert max(record["loss"] for record in training.values()) < 100  # skipped before it ran away
    assert not list((run_dir / "checkpoints").glob("step_*"))  # every checkpoint holds blown-up weights


def test_a_spike_is_skipped_and_the_curve_equals_the_run_without_that_batch(trained):
    """The update of the spiking batch is dropped, its batch consumed: bit for bit the run whose update of
    that step was dropped for a non-finite loss."""
    spike, dropped = trained("spike"), trained("dropped")
    skipped = [spike[step]["skipped_steps"] for step in range(1, STEPS + 1)]
    assert skipped == [0] * (SPIKE - 1) + [1] * (STEPS - SPIKE + 1)
    assert spike[SPIKE]["spike_steps"] == 1 and spike[SPIKE]["spike/loss_z"] > 6
    assert all(spike[step]["loss"] == dropped[step]["loss"] for step in range(1, STEPS + 1) if step != SPIKE)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_every_layout_skips_the_same_step(trained, layout: str):
    """The loss the rule judges is agreed over the world group, so two data-parallel or tensor-parallel ranks
    skip the one rank's step, and train on as one rank does."""
    one, two = trained("spike"), trained(layout)
    assert [two[step]["skipped_steps"] for step in sorted(two)] == [one[step]["skipped_steps"] for step in sorted(one)]
    for step in range(1, STEPS + 1):
        if step != SPIKE:
            assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step


def test_a_run_of_spikes_rewinds_to_the_last_good_checkpoint_and_a_rerun_reproduces_it(
    small_dataset: Path, tmp_path: Path
):
    """Batches 9-11 spike (patience 3): the run sets aside the checkpoint of step 8, rewinds to step 4,
    skips 8 batches (5-12, the bad ones among them) and trains to the end; a rerun does the same bit for bit."""
    extra = ["train.spike.inject_at=[9,10,11]", "train.spike.patience=3", "train.spike.rewind=true",
             "train.spike.rewind_skip_batches=8", "train.steps=16"]
    curves = []
    for name in ("first", "rerun"):
        run_dir = tmp_path / name
        result = subprocess.run([*launcher(1), "train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir, *extra)],
                                cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "rewound to" in result.stderr and "step_00000004 (step 4), skipping samples 32-95" in result.stderr
        assert [path.name for path in (run_dir / "checkpoints" / "diverged").iterdir()] == ["step_00000008"]
        training, _ = read_metrics(run_dir)
        assert training[16]["skipped_steps"] == 0 and training[16]["spike_steps"] == 0  # the checkpoint's counts
        curves.append([training[step]["loss"] for step in range(1, 17)])
    assert curves[0] == curves[1]
