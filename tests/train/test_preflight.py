"""`scaletrain check`: a summary and exit 0 for a run `train` would start, one clear error and exit 2
for one it would refuse (bad override, layout, missing data, busy run directory, foreign checkpoint,
a checkpoint directory that cannot be written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main
from tests.train.runs import DEMO_CONFIG, REPO, tiny_overrides


def check(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    exit_code = main(["check", str(DEMO_CONFIG), *args])
    captured = capsys.readouterr()
    return exit_code, captured.out, captured.err


def test_a_good_run_is_summarised(small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    exit_code, out, err = check(capsys, *tiny_overrides(small_dataset, tmp_path / "run"), "train.steps=30",
                                "--world-size", "2")

    assert (exit_code, err) == (0, "")
    assert "ok: gpt, 167,680 parameters (100,096 non-embedding)" in out
    assert "layout: world 2 = TP 1 x DP 2 x PP 1" in out
    assert "batch: global 8 = micro 4 x grad_accum 1 x DP 2; 256 tokens per step, 30 steps, 7,680 tokens" in out
    assert f"data: {small_dataset}, vocab 1024, train " in out
    assert f"run: {tmp_path / 'run'} starts at step 0" in out
    assert not (tmp_path / "run").exists(), "check creates nothing"


def test_a_bad_override_is_named(small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    exit_code, out, err = check(capsys, *tiny_overrides(small_dataset, tmp_path / "run"), "train.lr=fast")

    assert (exit_code, out) == (2, "")
    assert err.startswith("scaletrain check: error: ") and "train.lr" in err and "fast" in err


def test_a_world_size_the_layout_cannot_use(small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    exit_code, _, err = check(capsys, *tiny_overrides(small_dataset, tmp_path / "run"), "parallel.tensor=2",
                              "--world-size", "3")

    assert exit_code == 2
    assert "world size 3 is not divisible by parallel.tensor x parallel.context x parallel.pipeline = 2 x 1 x 1" in err


def test_a_tp_group_the_launcher_would_put_across_nodes(small_dataset: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """With the ranks per node (launch/slurm.sbatch passes them), TP4 on 2 ranks per node is refused
    before any rank starts; TP2 on the same nodes passes; a world that is no whole number of nodes too."""
    base = [*tiny_overrides(small_dataset, tmp_path / "run"), "model.num_heads=4", "--world-size", "4"]
    exit_code, out, err = check(capsys, *base, "parallel.tensor=2", "--ranks-per-node", "2")
    assert (exit_code, err) == (0, "") and "layout: world 4 = TP 2 x DP 2 x PP 1" in out

    exit_code, out, err = check(capsys, *base, "parallel.tensor=4", "--ranks-per-node", "2")
    assert (exit_code, out) == (2, "")
    assert err == ("scaletrain check: error: parallel.tensor=4 puts TP group ranks 0-3 on hosts node1, node2: a TP "
                   "group must stay inside a node (it all-reduces every layer); use parallel.tensor <= 2 (the ranks "
                   "per node), dividing it, or more ranks per node\n")

    exit_code, _, err = check(capsys, *base, "parallel.tensor=2", "--ranks-per-node", "3")
    assert exit_code == 2 and "--ranks-per-node 3 does not divide --world-size 4" in err


def test_missing_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    exit_code, _, err = check(capsys, *tiny_overrides(tmp_path / "nowhere", tmp_path / "run"))

    assert exit_code == 2
    assert f"no manifest.json in {tmp_path / 'nowhere'}" in err and "scaletrain prepare" in err


def test_a_vocabulary_the_data_was_not_prepared_with(small_dataset: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    exit_code, _, err = check(capsys, *tiny_overrides(small_dataset, tmp_path / "run"), "data.vocab_size=2048")

    assert exit_code == 2
    assert "data.vocab_size=2048" in err and "set data.vocab_size=1024" in err


def test_a_run_directory_in_use(small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # as a training rank 0 holds it: in another process (a POSIX record lock belongs to its process)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from scaletrain.train.run_lock import "
         f"RunDirectoryLock; lock = RunDirectoryLock(Path({str(tmp_path / 'run')!r})); lock.acquire(); print('locked', "
         "flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        exit_code, _, err = check(capsys, *tiny_overrides(small_dataset, tmp_path / "run"))
    finally:
        holder.communicate("")

    assert exit_code == 2
    assert f"run.dir={tmp_path / 'run'} is in use by pid {holder.pid} " in err
    assert check(capsys, *tiny_overrides(small_dataset, tmp_path / "run"))[0] == 0, "free once released"


def test_a_checkpoint_of_another_layout(small_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000010"
    checkpoint.mkdir(parents=True)
    layout = {"tensor": 1, "pipeline": 1, "data": 2, "zero_stage": 1}
    meta = {"format": 2, "step": 10, "consumed_samples": 80, "layout": layout}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    overrides = [*tiny_overrides(small_dataset, tmp_path / "run"), "parallel.zero_stage=1"]

    exit_code, out, _ = check(capsys, *overrides, "--world-size", "2")
    assert exit_code == 0 and f"resumes at step 10 of 300 from {checkpoint}" in out
    exit_code, out, _ = check(capsys, *overrides, "--world-size", "1")
    assert exit_code == 0 and f"resumes at step 10 of 300 from {checkpoint} (resharded from DP2 ZeRO-1)" in out
    exit_code, out, _ = check(capsys, *overrides, "parallel.zero_stage=3", "--world-size", "2")
    assert exit_code == 0 and f"resumes at step 10 of 300 from {checkpoint} (resharded from DP2 ZeRO-1)" in out
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "format": 1}))  # DeepSpeed's own files
    exit_code, _, err = check(capsys, *overrides, "--world-size", "2")
    assert exit_code == 2
    assert f"checkpoint {checkpoint} is in format 1" in err
    assert "finish that run with the scaletrain that wrote it" in err


@pytest.mark.parametrize("obstacle", ["file", "symlink loop", "run.dir a file"])
def test_a_checkpoint_directory_that_cannot_be_written(obstacle: str, small_dataset: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """check said ok, and train learned of it a checkpoint interval late, with nothing saved. Root writes
    through a read-only mode, so these block the way with what root cannot write through."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    if obstacle == "run.dir a file":
        run_dir.write_text("in the way")
    elif obstacle == "file":
        run_dir.mkdir()
        checkpoints.write_text("in the way")
    else:
        run_dir.mkdir()
        checkpoints.symlink_to(checkpoints)
    exit_code, out, err = check(capsys, *tiny_overrides(small_dataset, run_dir))

    culprit = {"file": f"{checkpoints} is not a writable directory (not a directory)",
               "symlink loop": f"{checkpoints} is not a writable directory (Too many levels of symbolic links)",
               "run.dir a file": f"{checkpoints} cannot be made: {run_dir} is not a writable directory (not a "
                                 "directory)"}[obstacle]
    assert (exit_code, out) == (2, "")
    assert err == (f"scaletrain check: error: {culprit}, so no checkpoint could be saved; make it one (move away "
                   "what is there) or set run.dir to another directory\n")
