"""Warmup-stable-decay: the schedule against hand-computed values, its config refusals, and a cooldown
branch of a constant-LR run that equals a fresh WSD run of the branch's length bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.resume_policy import check_branch_point, resume_candidates
from scaletrain.checkpoint.safe_load import load_tensors
from scaletrain.config import ConfigError, TrainConfig
from scaletrain.config_loader import load_config
from scaletrain.train.schedule import learning_rate
from tests.train.runs import DEMO_CONFIG, read_metrics, run_scaletrain, tiny_overrides

STEPS, BRANCH_STEP = 24, 18  # a 25% cooldown of 24 steps starts after step 18


def wsd(**changes: object) -> TrainConfig:
    values = {"steps": 10, "lr": 1.0, "min_lr": 0.1, "warmup_steps": 0, "lr_schedule": "wsd",
              "cooldown_fraction": 0.4, "cooldown_shape": "linear", **changes}
    return TrainConfig(**values)


def test_wsd_linear_and_sqrt_cooldowns() -> None:
    # 10 steps, 40% cooldown: updates 0-5 at peak, 6-9 decay with progress 1/4, 2/4, 3/4, 4/4
    linear = [learning_rate(step, wsd()) for step in range(10)]
    assert linear == pytest.approx([1.0] * 6 + [0.775, 0.55, 0.325, 0.1], abs=1e-12)
    root = [learning_rate(step, wsd(cooldown_shape="sqrt")) for step in range(10)]
    assert root == pytest.approx([1.0] * 6 + [0.1 + 0.9 * (1 - math.sqrt(p)) for p in (0.25, 0.5, 0.75, 1.0)])
    assert root[-1] == 0.1  # the last update uses min_lr exactly


def test_wsd_warmup_and_no_cooldown() -> None:
    warm = [learning_rate(step, wsd(warmup_steps=2, cooldown_fraction=0.2)) for step in range(10)]
    assert warm == pytest.approx([0.5, 1.0] + [1.0] * 6 + [0.55, 0.1])
    assert [learning_rate(step, wsd(warmup_steps=2, cooldown_fraction=0.0)) for step in range(10)] == (
        [0.5] + [1.0] * 9)
    # the cosine default is unchanged
    cosine = TrainConfig(steps=10, lr=1.0, min_lr=0.1)
    assert learning_rate(5, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize(("override", "message"), [
    ("train.lr_schedule=linear", "train.lr_schedule='linear'; use cosine or wsd"),
    ("train.cooldown_fraction=1.0", "train.cooldown_fraction=1.0 must be in [0, 1)"),
    ("train.cooldown_fraction=-0.1", "train.cooldown_fraction=-0.1 must be in [0, 1)"),
    ("train.cooldown_shape=cosine", "train.cooldown_shape='cosine'; use sqrt or linear"),
    ("train.warmup_steps=90 train.branch_from=runs/stable/checkpoints/step_00000080",
     "train.warmup_steps=90 plus the cooldown of 20 steps"),  # a run that is no branch has its warmup cut
    ("checkpoint.keep_steps=[0,50]", "checkpoint.keep_steps has [0], outside [1, train.steps=100]"),
])
def test_schedule_refusals_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(DEMO_CONFIG, ["train.steps=100", "train.lr_schedule=wsd", *override.split()])
    assert message in str(error.value)


def train_tiny(data_dir: Path, run_dir: Path, *changes: str) -> Path:
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(data_dir, run_dir), "train.lr_schedule=wsd",
                             "train.eval_every=6", "checkpoint.every=100", *changes])
    return run_dir


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wsd")
    fresh = train_tiny(small_dataset, root / "fresh", f"train.steps={STEPS}", "train.cooldown_fraction=0.25")
    stable = train_tiny(small_dataset, root / "stable", f"train.steps={BRANCH_STEP}", "train.cooldown_fraction=0",
                        "checkpoint.every=4", "checkpoint.keep_last=1", f"checkpoint.keep_steps=[{BRANCH_STEP}, 8]")
    point = stable / "checkpoints" / f"step_{BRANCH_STEP:08d}"
    branch = train_tiny(small_dataset, root / "branch", f"train.steps={STEPS}", "train.cooldown_fraction=0.25",
                        f"train.branch_from={point}")
    return {"fresh": fresh, "stable": stable, "branch": branch, "point": point, "data": small_dataset}


def test_branch_equals_a_fresh_wsd_run(runs: dict[str, Path]) -> None:
    fresh_train, fresh_val = read_metrics(runs["fresh"])
    branch_train, branch_val = read_metrics(runs["branch"])
    assert sorted(branch_train) == list(range(BRANCH_STEP + 1, STEPS + 1))
    for step in branch_train:
        assert branch_train[step]["loss"] == fresh_train[step]["loss"], step
        assert branch_train[step]["lr"] == fresh_train[step]["lr"], step
    assert branch_val[STEPS] == fresh_val[STEPS]
    final = f"checkpoints/step_{STEPS:08d}/model/rank_00000.pt"
    fresh_weights, branch_weights = (weights(runs[name] / final) for name in ("fresh", "branch"))
    assert fresh_weights.keys() == branch_weights.keys() and fresh_weights
    assert all(torch.equal(fresh_weights[key], branch_weights[key]) for key in fresh_weights)
    assert load_config(runs["branch"] / "config.yaml").train.branch_from == str(runs["point"])


def weights(rank_file: Path) -> dict[str, torch.Tensor]:
    """The model's weights and Adam moments in rank 0's state file (one rank: the whole model)."""
    return {f"{piece['name']}/{key}": tensor for piece in load_tensors(rank_file)["pieces"]
            for key, tensor in piece["tensors"].items()}


def test_keep_steps_survive_pruning(runs: dict[str, Path]) -> None:
    kept = sorted(path.name for path in (runs["stable"] / "checkpoints").glob("step_*"))
    assert kept == ["step_00000008", f"step_{BRANCH_STEP:08d}"]  # keep_last=1 pruned steps 4, 12 and 16


def branch_config(runs: dict[str, Path], run_dir: Path, *changes: str):
    return load_config(DEMO_CONFIG, [*tiny_overrides(runs["data"], run_dir), "train.lr_schedule=wsd",
                                     f"train.branch_from={runs['point']}", *changes])


def test_an_interrupted_branch_resumes_its_own_checkpoints(runs: dict[str, Path]) -> None:
    config = branch_config(runs, runs["branch"], f"train.steps={STEPS}", "train.cooldown_fraction=0.25")
    assert resume_candidates(config) == [runs["branch"] / "checkpoints" / f"step_{STEPS:08d}"]


def test_branch_refusals(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"train.lr=0.003 there, 0.001 here.*train.branch_from=null"):
        resume_candidates(branch_config(runs, tmp_path / "a", "train.steps=30", "train.lr=1e-3"))
    with pytest.raises(CheckpointError, match=f"is at step {BRANCH_STEP}, not before train.steps={BRANCH_STEP}"):
        resume_candidates(branch_config(runs, tmp_path / "b", f"train.steps={BRANCH_STEP}",
                                        "train.cooldown_fraction=0"))
    with pytest.raises(CheckpointError, match="no complete checkpoint there"):
        check_branch_point(tmp_path, branch_config(runs, tmp_path / "c", "train.steps=30"))
    # the schedule, length, run directory and evaluation may differ
    config = branch_config(runs, tmp_path / "d", "train.steps=40", "train.cooldown_shape=linear", "train.eval_every=5")
    assert resume_candidates(config) == [runs["point"]]
