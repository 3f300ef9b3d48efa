"""What a resume may change, said and refused in one line each (issue 37): a resume names every
change since its checkpoint and the LR before and now; another model, seed, global batch or tokenizer
is refused before the first step; a finished run says there is nothing to train; train.resume=never
in a used run directory is refused; an explicit train.resume=PATH is a starting point once. `check`
runs the same rules as `train`, so each refusal is the same line from both (resume_policy.resume_rules).
Each case is run as a user runs it, on a copy of one short trained run."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.config import TrainConfig
from scaletrain.train.schedule import learning_rate
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


def overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=0", "checkpoint.every=2",
            "checkpoint.keep_last=3", *extra]


@pytest.fixture(scope="module")
def trained_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints at steps 2 and 4 (global batch 8 = micro 4 x grad_accum 2); tests work on copies."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides(small_dataset, run_dir)])
    return run_dir


def copied(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def run_files(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files (its lock aside: a start writes its pid there)."""
    return {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file() and path.name != ".lock"}


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def train_time(checkpoint_dir: Path) -> float:
    """The run's training time up to the checkpoint's step, as its meta.json carries it (SpeedMonitor's state)."""
    return json.loads((checkpoint_dir / "meta.json").read_text())["hooks"]["SpeedMonitor"]["train_time_s"]


def train(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(nproc), "train", str(DEMO_CONFIG), *args], cwd=REPO,
                          env=scaletrain_environment(), capture_output=True, text=True, timeout=600)


def error_line(output: str, command: str) -> str:
    """The one error a command printed, without its `scaletrain COMMAND: error: ` prefix."""
    prefix = f"scaletrain {command}: error: "
    errors = {line.removeprefix(prefix) for line in output.splitlines() if line.startswith(prefix)}
    assert len(errors) == 1, output[-3000:]
    return errors.pop()


def refused_differences(run_dir: Path, tmp_path: Path) -> tuple[list[str], str]:
    return (["train.steps=6", "train.seed=7", "train.weight_decay=0.01"],
            f"cannot resume from {checkpoint(run_dir, 4)}: train.seed 1234 there, 7 here; train.weight_decay 0.1 "
            "there, 0.01 here; a resume may change the LR schedule and length, cadence, tracking and layout, not "
            f"these. Set them back as the run had them ({checkpoint(run_dir, 4) / 'config.yaml'}), or train this "
            "config as a new run (a new run.dir)")


def another_shape(run_dir: Path, tmp_path: Path) -> tuple[list[str], str]:
    return (["train.steps=6", "model.hidden_size=32", "model.num_heads=2"],
            f"cannot resume from {checkpoint(run_dir, 4)}: model.hidden_size 64 there, 32 here; model.num_heads 4 "
            "there, 2 here; a resume may change")


def another_global_batch(run_dir: Path, tmp_path: Path) -> tuple[list[str], str]:
    """Two ranks with the micro-batch and grad_accum as they were: a layout the run cannot reshard into."""
    return (["train.steps=6", "train.global_batch_size=null", "train.grad_accum=2"],
            f"cannot resume from {checkpoint(run_dir, 4)}: global batch 8 there, 16 here (set "
            "train.global_batch_size=8 to cut it for this layout); a resume may change")


def never_in_a_used_run_dir(run_dir: Path, tmp_path: Path) -> tuple[list[str], str]:
    return (["train.resume=never"],
            f"train.resume=never, but run.dir={run_dir} holds the checkpoints of a run (the newest: step_00000004); "
            f"to start a new run give a new run.dir, or move the old run aside (mv {run_dir} {run_dir}-previous) "
            "and run again; to continue it set train.resume=auto")


def missing_init_from(run_dir: Path, tmp_path: Path) -> tuple[list[str], str]:
    missing = tmp_path / "missing.pt"
    return ([f"run.dir={tmp_path / 'fresh'}", f"train.init_from={missing}"],
            f"train.init_from={missing} does not exist; give the file `scaletrain import")


# name -> (case, ranks): each a refusal `train` makes before its first step
REFUSALS = {"refused differences": (refused_differences, 1), "another shape": (another_shape, 1),
            "another global batch": (another_global_batch, 2), "resume=never": (never_in_a_used_run_dir, 1),
            "missing init_from": (missing_init_from, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFUSALS))
def test_check_refuses_with_trains_line(name: str, trained_run: Path, small_dataset: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    run_dir = copied(trained_run, tmp_path)
    case, nproc = REFUSALS[name]
    extra, expected = case(run_dir, tmp_path)
    args = overrides(small_dataset, run_dir, *extra)
    before = run_files(run_dir)

    trained = train(args, nproc)
    assert trained.returncode == (2 if nproc == 1 else 1), trained.stderr[-3000:]
    line = error_line(trained.stderr, "train")
    assert line.startswith(expected), line
    assert nproc > 1 or "Traceback" not in trained.stderr  # torchrun adds its own report of a failed rank
    assert sorted(path.name for path in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002",
                                                                                       "step_00000004"]
    assert run_files(run_dir) == before, "a refused start leaves the run directory as it was (metrics.jsonl too)"

    assert main(["check", str(DEMO_CONFIG), *args, "--world-size", str(nproc)]) == 2
    assert error_line(capsys.readouterr().err, "check") == line


@pytest.mark.slow
@pytest.mark.parametrize("steps", [STEPS, STEPS - 1])
def test_a_run_at_or_past_its_steps_has_nothing_to_train(steps: int, trained_run: Path, small_dataset: Path,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """It said "finished: 4 steps, 1,024 tokens, 0 s in this invocation; final no evaluation (eval_every=0)",
    as if it had trained them (with eval_every > 0 too)."""
    run_dir = copied(trained_run, tmp_path)
    args = overrides(small_dataset, run_dir, f"train.steps={steps}")
    line = f"nothing to train: {run_dir} is at step {STEPS} of {steps}; raise train.steps to train on"
    trained = train(args)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert trained.stderr.strip().splitlines()[-1] == line and "finished:" not in trained.stderr
    assert main(["check", str(DEMO_CONFIG), *args]) == 0
    assert capsys.readouterr().out == line + "\n"


@pytest.mark.slow
def test_a_resume_names_every_change_and_the_lr_before_and_now(trained_run: Path, small_dataset: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = copied(trained_run, tmp_path)
    args = overrides(small_dataset, run_dir, "train.steps=6", "train.lr=1e-3", "train.micro_batch_size=2")
    before = TrainConfig(steps=STEPS, lr=3e-3, min_lr=3e-4, warmup_steps=2)
    now = TrainConfig(steps=6, lr=1e-3, min_lr=3e-4, warmup_steps=2)
    changes = (f"changed since: train.steps 4 -> 6, train.lr 0.003 -> 0.001, train.micro_batch_size 4 -> 2, "
               f"train.grad_accum 2 -> 4, run.dir {trained_run} -> {run_dir}; LR at step 5: "
               f"{learning_rate(STEPS, before):.3g} before, {learning_rate(STEPS, now):.3g} now (cosine to 0.0003 "
               "at step 6)")

    assert main(["check", str(DEMO_CONFIG), *args]) == 0
    assert f"run: {run_dir} resumes at step 4 of 6 from {checkpoint(run_dir, 4)}; {changes}\n" in \
        capsys.readouterr().out
    trained = train(args)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"; resuming at step 4 from {checkpoint(run_dir, 4)}; {changes}; run dir {run_dir}" in trained.stderr

    step_times = {step: record["step_time_s"] for step, record in read_metrics(run_dir)[0].items()}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_time_s"] == pytest.approx(train_time(checkpoint(run_dir, 4)) + step_times[5] + step_times[6])

    resumed_again = train(args + ["train.steps=7"])  # nothing else changed since step 6
    assert f"resuming at step 6 from {checkpoint(run_dir, 6)}; changed since: train.steps 6 -> 7; LR at step 7: " \
        in resumed_again.stderr, resumed_again.stderr[-3000:]


@pytest.mark.slow
def test_an_explicit_resume_path_is_a_starting_point_once(trained_run: Path, small_dataset: Path, tmp_path: Path):
    """train.resume=PATH behind a newer checkpoint of the same run (going back to step 2): a rerun of the
    same command re-resumed at PATH every time (or, by step, would take the abandoned step 4); it goes
    on from the checkpoint the run saved since it started at PATH."""
    run_dir = copied(trained_run, tmp_path)
    args = overrides(small_dataset, run_dir, "train.steps=8", f"train.resume={checkpoint(run_dir, 2)}",
                     "train.exit_after=1")
    first = train(args)
    assert first.returncode == 75, first.stderr[-3000:]
    assert f"resuming at step 2 from {checkpoint(run_dir, 2)}" in first.stderr
    meta = json.loads((checkpoint(run_dir, 3) / "meta.json").read_text())
    assert meta["started_from"] == str(checkpoint(run_dir, 2).resolve())
    # the training time is carried on from step 2's checkpoint (SpeedMonitor's hook state), not step 4's
    step_3 = read_metrics(run_dir)[0][3]
    carried_on = train_time(checkpoint(run_dir, 2)) + step_3["step_time_s"]
    assert train_time(checkpoint(run_dir, 3)) == pytest.approx(carried_on) == step_3["train_time_s"]

    rerun = train(args)
    assert rerun.returncode == 75, rerun.stderr[-3000:]
    assert f"resuming at step 3 from {checkpoint(run_dir, 3)}" in rerun.stderr


@pytest.mark.slow
def test_a_dataset_prepared_again_with_another_tokenizer_is_refused(
    small_dataset: Path, small_dataset_raw: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`prepare --force` with other raw text (the same vocabulary size) trains another tokenizer: the
    checkpoint's token ids mean other text. Resuming on it exited 0 without a word."""
    data_dir, run_dir = Path(shutil.copytree(small_dataset, tmp_path / "data")), tmp_path / "run"
    args = [*tiny_overrides(data_dir, run_dir), "train.steps=2", "train.eval_every=0"]
    run_scaletrain("train", [str(DEMO_CONFIG), *args])
    trained_with = json.loads((data_dir / "manifest.json").read_text())["tokenizer_sha256"]
    other_raw = f"data.raw=[{small_dataset_raw[0]},{small_dataset_raw[1]}]"
    run_scaletrain("prepare", [str(DEMO_CONFIG), *args, other_raw, "data.val_fraction=0.3", "--force"])
    prepared_with = json.loads((data_dir / "manifest.json").read_text())["tokenizer_sha256"]
    assert prepared_with != trained_with

    resumed = train([*args, "train.steps=4"])
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    line = error_line(resumed.stderr, "train")
    assert line == (f"cannot resume from {checkpoint(run_dir, 2)}: it was trained on tokens of tokenizer sha256 "
                    f"{trained_with[:12]}..., but {data_dir} is now prepared with tokenizer sha256 "
                    f"{prepared_with[:12]}... (prepared again?), whose token ids mean other text; resume on the "
                    "data the run was prepared with, or train this data as a new run (a new run.dir)")
    assert main(["check", str(DEMO_CONFIG), *args, "train.steps=4"]) == 2
    assert error_line(capsys.readouterr().err, "check") == line
