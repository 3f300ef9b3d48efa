"""A run's checkpoints as a hint and a fallback (issue 20): a garbled `latest`, a truncated newest
checkpoint, what a killed prune leaves, a config of another shape, keep_last=1 after a fallback
(issue 37). Each probe is run as a user runs
it (train, generate, export as subprocesses) on copies of one short trained run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.format import complete_checkpoints
from scaletrain.checkpoint.publishing import prune_checkpoints
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    run_scaletrain,
    scaletrain_environment,
    start_training,
    tiny_overrides,
    wait_for_step,
)


def overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(data_dir, run_dir), "train.steps=8", "train.eval_every=0", "checkpoint.every=4",
            "checkpoint.keep_last=2", *extra]


@pytest.fixture(scope="module")
def trained_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints at steps 4 and 8; tests work on copies (`copied`)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir)])
    return run_dir


def copied(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def scaletrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(1), *args], cwd=REPO, env=scaletrain_environment(), capture_output=True,
                          text=True, timeout=600)


def model_states(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}" / "model" / "rank_00000.pt"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.slow
def test_binary_garbage_in_latest_is_only_a_hint(trained_run: Path, small_dataset: Path, tmp_path: Path):
    """It used to stop train, generate and export with a bare UnicodeDecodeError."""
    run_dir = copied(trained_run, tmp_path)
    (run_dir / "checkpoints" / "latest").write_bytes(b"\xb1\x07\xff\x00garbage")
    newest = run_dir / "checkpoints" / "step_00000008"
    generated = scaletrain("generate", str(run_dir), "--max-new-tokens", "4")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert f"names 'unreadable (UnicodeDecodeError)', not the newest complete checkpoint: using {newest}" \
        in generated.stderr
    exported = scaletrain("export", str(run_dir), str(tmp_path / "hf"))
    assert exported.returncode == 0 and (tmp_path / "hf" / "config.json").is_file(), exported.stderr[-2000:]
    resumed = scaletrain("train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.steps=9"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming at step 8 from {newest}" in resumed.stderr and "names 'unreadable" in resumed.stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000009", "the next save rewrites it"


@pytest.mark.slow
def test_generate_and_export_fall_back_past_a_truncated_newest_checkpoint(trained_run: Path, tmp_path: Path):
    """They used to crash with a 12-frame `[rank0]` traceback; now a warning names the checkpoint they
    skip, one line the checkpoint they used, and with none left one line says so."""
    run_dir = copied(trained_run, tmp_path)
    truncate(model_states(run_dir, 8))
    commands = (["generate", str(run_dir), "--max-new-tokens", "4"], ["export", str(run_dir), str(tmp_path / "hf")])
    for command in commands:
        result = scaletrain(*command)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"warning: skipping checkpoint {run_dir / 'checkpoints' / 'step_00000008'}" in result.stderr
        assert f"trying {run_dir / 'checkpoints' / 'step_00000004'}" in result.stderr
        assert f"using checkpoint {run_dir / 'checkpoints' / 'step_00000004'} (step 4)" in result.stderr
        assert "Traceback" not in result.stderr
    assert (tmp_path / "hf" / "config.json").is_file()
    truncate(model_states(run_dir, 4))
    for command in (["generate", str(run_dir)], ["export", str(run_dir), str(tmp_path / "hf2")]):
        result = scaletrain(*command)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith(f"scaletrain {command[0]}: error:")]
        assert len(errors) == 1 and f"none of the 2 checkpoints of {run_dir} could be loaded" in errors[0]
        assert "Traceback" not in result.stderr and "[rank0]" not in result.stderr
    assert not (tmp_path / "hf2").exists()


@pytest.mark.slow
def test_leftovers_of_killed_saves_and_prunes_are_removed_at_start(
    trained_run: Path, small_dataset: Path, tmp_path: Path
):
    """kill -9 during pruning used to leave an empty step_ directory that was never pruned."""
    run_dir = copied(trained_run, tmp_path)
    root = run_dir / "checkpoints"
    leftovers = [root / "step_00000002", root / ".pruning-step_00000001", root / ".staging-step_00000012"]
    for path in leftovers:
        (path / "model").mkdir(parents=True)
    result = scaletrain("train", str(DEMO_CONFIG), *overrides(small_dataset, run_dir, "train.steps=9"))
    assert result.returncode == 0, result.stderr[-2000:]
    for path in leftovers:
        assert not path.exists() and f"removed {path}: left by a save or prune that was killed" in result.stderr
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000008", "step_00000009"]


@pytest.mark.slow
def test_a_config_of_another_shape_names_the_keys_and_both_ways_on(
    trained_run: Path, small_dataset: Path, tmp_path: Path
):
    """It used to say "Delete the broken checkpoints": the checkpoints are fine, the config changed."""
    run_dir = copied(trained_run, tmp_path)
    other_shape = overrides(small_dataset, run_dir, "train.steps=9", "model.hidden_size=32", "model.num_heads=2")
    result = scaletrain("train", str(DEMO_CONFIG), *other_shape)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert (f"cannot resume from {run_dir / 'checkpoints' / 'step_00000008'}: model.hidden_size 64 there, 32 here; "
            "model.num_heads 4 there, 2 here;") in errors[0]
    assert "Set them back as the run had them" in errors[0] and "as a new run (a new run.dir)" in errors[0]
    assert "Delete the broken" not in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000008"]


@pytest.mark.slow
def test_keep_last_1_keeps_the_checkpoint_a_run_fell_back_to(trained_run: Path, small_dataset: Path, tmp_path: Path):
    """The newest checkpoint broken, the run resumed from the one before, then pruned *that* one at its
    first step (the broken one counted as the newest to keep): a kill before the next save left nothing
    loadable. The broken one is set aside in checkpoints/rejected/ now, uncounted."""
    run_dir = copied(trained_run, tmp_path)
    truncate(model_states(run_dir, 8))
    (run_dir / "metrics.jsonl").unlink()  # wait_for_step then sees this run's steps alone
    log = tmp_path / "train.log"
    process = start_training(overrides(small_dataset, run_dir, "train.steps=100", "checkpoint.every=50",
                                       "checkpoint.keep_last=1"), log=log)
    try:
        wait_for_step(run_dir, 6, process)  # the prune ran after step 5, the first since resuming
    finally:
        process.kill()
        process.wait()
    root = run_dir / "checkpoints"
    assert "resuming at step 4" in log.read_text(), log.read_text()[-3000:]
    assert complete_checkpoints(run_dir) == [root / "step_00000004"]
    consolidated_state_dict(root / "step_00000004")  # loads
    assert (root / "rejected" / "step_00000008" / "meta.json").is_file()
    assert f"moved step_00000008 to {root / 'rejected'}: it could not be loaded" in log.read_text()


def test_pruning_keeps_the_checkpoint_the_run_resumed_from_until_it_saves_a_newer_one(tmp_path: Path):
    """train.resume=PATH behind a newer checkpoint, keep_last=1: the newer one, not this run's, used to
    push out the one the run resumed from."""
    root = tmp_path / "checkpoints"
    older, newer = root / "step_00000004", root / "step_00000008"
    for checkpoint in (older, newer):
        checkpoint.mkdir(parents=True)
        (checkpoint / "meta.json").write_text("{}")
    prune_checkpoints(tmp_path, keep_last=1, keep_steps=[], keep=older)
    assert complete_checkpoints(tmp_path) == [older, newer]
    prune_checkpoints(tmp_path, keep_last=1, keep_steps=[], keep=newer)  # once the run has saved step 8 itself
    assert complete_checkpoints(tmp_path) == [newer]
