"""A mini IsoFLOP sweep through the CLI: runs, results.csv, fit, plots, W&B group; and an interrupted
sweep that, run again, trains only its unfinished runs and ends with the same results. The module's three
sweeps (finished, interrupted, on 2 ranks) are independent: each one after the first runs while the tests
of the one before check it."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from scaletrain.cli import main
from scaletrain.config import ConfigError
from scaletrain.scaling.fit_plots import PLOT_FILES
from scaletrain.scaling.sweep.executors import check_one_corpus, materialize, run_local
from scaletrain.scaling.sweep.plan import plan_sweep
from scaletrain.scaling.sweep.results import RESULT_COLUMNS, run_data_fingerprint, run_status, write_status_file
from scaletrain.scaling.sweep.spec import load_sweep_spec
from scaletrain.tracking.durations import format_duration
from tests.scaling.sweeps import TINY_BUDGETS, TINY_SHAPES, in_process_loading, tiny_spec, write_spec
from tests.tracking.wandb_records import read_records, run_record
from tests.train.runs import REPO, TrainedAhead, launcher, run_scaletrain, scaletrain_environment
from tests.warm import default_sigint, fork_of, process_tree

NUM_RUNS = len(TINY_BUDGETS) * len(TINY_SHAPES)
COMPARED = ("name", "status", "params", "non_embedding_params", "tokens", "flops", "val_loss", "train_loss", "steps")


@dataclass(frozen=True)
class InterruptedSweep:
    sweep_dir: Path
    planned: list[str]  # the runs' names in the order the sweep trains them
    done_before: list[str]  # the runs that had finished when the sweep was killed
    output: str  # of the sweep run again


def finish_sweep(data_dir: Path, root: Path) -> tuple[Path, Path, str]:
    """Every run of the tiny sweep, W&B offline: (spec, sweep directory, output). Its runs load their
    batches in-process and keep one checkpoint (in_process_loading): the interrupted sweep, which keeps
    the loader worker and four checkpoints a run, must end with the same losses."""
    spec = in_process_loading(tiny_spec(data_dir, root / "sweep", wandb="offline"))
    spec_path = write_spec(root / "spec.yaml", spec)
    return spec_path, root / "sweep", run_scaletrain("sweep", ["run", str(spec_path)], timeout=1500)


def interrupt_and_run_again(data_dir: Path, root: Path) -> InterruptedSweep:
    """The tiny sweep killed (SIGKILL to the sweep and its trainer, mid-run, as a preemption would) once
    its second run has written its first checkpoint, then run again. The sweep and its runs are warm
    forks (tests/warm.py), killed with kill_warm_tree (fresh processes imported torch and megatron-core
    for the sweep and each run it started). Its fit keeps one law form and no bootstrap, 6 s of CPU
    instead of 15: the tests read this sweep's runs and results.csv, never its fit (the finished sweep's
    tests check that)."""
    sweep_dir = root / "sweep"
    spec = tiny_spec(data_dir, sweep_dir, fit={"bootstrap": 0, "forms": ["kaplan"]})
    spec_path = write_spec(root / "spec.yaml", spec)
    planned = [run.name for run in plan_sweep(load_sweep_spec(spec_path)).runs]
    victim = sweep_dir / "runs" / planned[1] / "checkpoints" / "latest"
    sweep = subprocess.Popen([*launcher(1), "sweep", "run", str(spec_path)], cwd=REPO, env=scaletrain_environment(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not victim.exists() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_warm_tree(sweep.pid)
    sweep.wait()
    done_before = [name for name in planned if (sweep_dir / "runs" / name / "summary.json").exists()]
    return InterruptedSweep(sweep_dir, planned, done_before,
                            run_scaletrain("sweep", ["run", str(spec_path)], timeout=1500))


def kill_warm_tree(client: int) -> None:
    """SIGKILL a warm client and everything it stands for, at once, as a preemption would: the process
    tree of the client and of the fork it stands for (tests/warm.py fork_of), and of each warm client in
    them (a sweep's trainer), with its fork and that fork's children (a loader worker). Every process is
    stopped before any is killed, so none sees another die (a sweep would record its trainer failed);
    returns once all are gone."""
    tree = process_tree(client, follow_forks=True)
    for sent in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sent)
    deadline = time.monotonic() + 60
    for pid in tree:
        while _alive(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived its SIGKILL"
            time.sleep(0.01)


def _alive(pid: int) -> bool:
    """The process runs (a zombie, killed and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def sweep_with_torchrun(data_dir: Path, root: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny sweep's first budget, each run on 2 ranks: (sweep directory, `sweep run`'s result)."""
    sweep_dir = root / "sweep"
    spec = in_process_loading(tiny_spec(data_dir, sweep_dir, budgets=[TINY_BUDGETS[0]]))
    spec_path = write_spec(root / "spec.yaml", spec)
    return sweep_dir, subprocess.run(
        [*launcher(1), "sweep", "run", str(spec_path), "--executor", "torchrun", "--nproc", "2"], cwd=REPO,
        env=scaletrain_environment(), capture_output=True, text=True, timeout=1500)


def sweep_two_at_a_time(data_dir: Path, root: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny sweep's first budget, two runs at a time (`--jobs 2`): (sweep directory, `sweep run`'s result)."""
    sweep_dir = root / "sweep"
    spec = in_process_loading(tiny_spec(data_dir, sweep_dir, budgets=[TINY_BUDGETS[0]]))
    spec_path = write_spec(root / "spec.yaml", spec)
    return sweep_dir, subprocess.run([*launcher(1), "sweep", "run", str(spec_path), "--jobs", "2"], cwd=REPO,
                                     env=scaletrain_environment(), capture_output=True, text=True, timeout=1500)


SWEEPS = {"finished": finish_sweep, "interrupted": interrupt_and_run_again, "torchrun": sweep_with_torchrun,
          "two_at_a_time": sweep_two_at_a_time}


@pytest.fixture(scope="module")
def sweeps(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    """sweeps(name) of SWEEPS, each run once; the next one (in SWEEPS' order, the tests') runs in the
    background while the tests before it check theirs (a sweep's runs are single processes: one core)."""
    runs = TrainedAhead(lambda key, root: SWEEPS[key[0]](small_dataset, root),
                        lambda key: tmp_path_factory.mktemp(key[0]), [(name,) for name in SWEEPS])
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def finished_sweep(sweeps: TrainedAhead) -> tuple[Path, Path, str]:
    return sweeps("finished")


def read_results(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "results.csv").open() as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_every_run_finishes_with_its_planned_budget(finished_sweep: tuple[Path, Path, str]) -> None:
    _, sweep_dir, output = finished_sweep
    assert f"trained {NUM_RUNS} runs, skipped 0 already done, 0 failed" in output
    rows = read_results(sweep_dir)
    planned = {row["name"]: row for row in json.loads((sweep_dir / "plan.json").read_text())["runs"]}
    assert len(rows) == NUM_RUNS and list(rows[0]) == list(RESULT_COLUMNS)
    for row in rows:
        plan = planned[row["name"]]
        assert row["status"] == "done"
        assert int(row["steps"]) == plan["steps"] and int(row["tokens"]) == plan["tokens"]
        assert float(row["flops"]) == pytest.approx(float(row["budget"]), rel=0.05)
        assert 2.0 < float(row["val_loss"]) < 7.0 and 2.0 < float(row["train_loss"]) < 7.0
        assert float(row["wall_s"]) > 0
        metrics = [json.loads(line) for line in (sweep_dir / "runs" / row["name"] / "metrics.jsonl").open()]
        evaluations = [record["step"] for record in metrics if "val_loss" in record]
        assert evaluations[0] == 0 and evaluations[-1] == plan["steps"]  # every run ends with an evaluation
        assert metrics[-1]["val_loss"] == pytest.approx(float(row["val_loss"]))


@pytest.mark.slow
def test_fit_writes_every_key_and_valid_plots(finished_sweep: tuple[Path, Path, str]) -> None:
    _, sweep_dir, _ = finished_sweep
    fit = json.loads((sweep_dir / "fit" / "fit.json").read_text())
    for key in ("approach1", "approach2", "approach3", "predictions", "bootstrap", "laws", "chosen", "noise"):
        assert key in fit, key
    assert fit["fingerprints"] != "" and fit["flops_per_token"]["source"] == "measured"  # exact FLOPs, not 6ND
    plots = sorted((sweep_dir / "fit").glob("*.png"))
    assert sorted(path.name for path in plots) == sorted(PLOT_FILES)
    for path in plots:
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 200 and width > 200


@pytest.mark.slow
def test_every_wandb_run_carries_the_group(finished_sweep: tuple[Path, Path, str]) -> None:
    _, sweep_dir, _ = finished_sweep
    results = {row["name"]: row for row in read_results(sweep_dir)}
    for name, row in results.items():
        (run_file,) = (sweep_dir / "runs" / name / "wandb").glob("offline-run-*/run-*.wandb")
        record = run_record(run_file)
        assert (record.run_group, record.job_type, record.display_name) == ("tiny-isoflop", "sweep-run", name)
        assert "tiny-isoflop" in record.tags
        config = {item.key: json.loads(item.value_json) for item in record.config.update}
        assert config["params"] == int(row["params"]) and config["tokens"] == int(row["tokens"])
        assert config["flops"] == pytest.approx(float(row["flops"]))
        assert config["train"]["steps"] == int(row["steps"])  # every config key rides along
    (summary_file,) = (sweep_dir / "wandb").glob("offline-run-*/run-*.wandb")
    summary = run_record(summary_file)
    assert (summary.run_group, summary.job_type) == ("tiny-isoflop", "sweep-summary")
    logged = [record.WhichOneof("record_type") for record in read_records(summary_file)]
    assert "history" in logged


@pytest.mark.slow
def test_status_and_rerun(finished_sweep: tuple[Path, Path, str]) -> None:
    spec_path, sweep_dir, _ = finished_sweep
    status = run_scaletrain("sweep", ["status", str(spec_path)])
    assert f"{NUM_RUNS} done" in status
    for row in read_results(sweep_dir):
        assert f"{float(row['val_loss']):.4f}" in status
    assert f"trained 0 runs, skipped {NUM_RUNS} already done" in run_scaletrain("sweep", ["run", str(spec_path)])


@pytest.mark.slow
def test_fit_command_on_the_sweep(finished_sweep: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, sweep_dir, _ = finished_sweep
    output = run_scaletrain("fit", [str(sweep_dir), "--out", str(tmp_path / "fit"), "--bootstrap", "5",
                                    "--target-flops", "1e12"])
    fit = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert [prediction["flops"] for prediction in fit["predictions"]] == [1e12]
    assert "approach" in output.lower()


@pytest.mark.slow
def test_interrupted_sweep_trains_only_unfinished_runs(
    finished_sweep: tuple[Path, Path, str], sweeps: TrainedAhead
) -> None:
    _, reference_dir, _ = finished_sweep
    interrupted = sweeps("interrupted")
    sweep_dir, planned, output = interrupted.sweep_dir, interrupted.planned, interrupted.output
    assert planned == [row["name"] for row in read_results(reference_dir)]
    assert interrupted.done_before == planned[:1], "the kill should land in the second run, after its first checkpoint"

    assert f"trained {NUM_RUNS - 1} runs, skipped 1 already done, 0 failed" in output
    resumed = json.loads((sweep_dir / "runs" / planned[1] / "status.json").read_text())
    assert resumed["attempts"] == 2
    assert "resuming at step" in (sweep_dir / "runs" / planned[1] / "train.log").read_text()
    reference = {row["name"]: row for row in read_results(reference_dir)}
    for row in read_results(sweep_dir):
        assert {key: row[key] for key in COMPARED} == {key: reference[row["name"]][key] for key in COMPARED}


@pytest.mark.slow
def test_torchrun_executor_trains_the_same_runs_on_two_ranks(
    finished_sweep: tuple[Path, Path, str], sweeps: TrainedAhead
) -> None:
    """--executor torchrun --nproc 2: every run data-parallel on 2 ranks, same global batch, same model."""
    _, reference_dir, _ = finished_sweep
    sweep_dir, result = sweeps("torchrun")
    # three runs at one budget are too few for any fit: every run trains, then `sweep run` exits 1 saying so
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"the fit failed ({len(TINY_SHAPES)} of {len(TINY_SHAPES)} runs done)" in result.stderr
    assert f"trained {len(TINY_SHAPES)} runs" in result.stdout
    reference = {row["name"]: row for row in read_results(reference_dir)}
    for row in read_results(sweep_dir):
        assert "--nproc_per_node=2" in (sweep_dir / "runs" / row["name"] / "train.log").read_text()
        assert row["steps"] == reference[row["name"]]["steps"]
        # data-parallel reductions sum in another order: equal to float32 round-off, grown over the run
        assert float(row["val_loss"]) == pytest.approx(float(reference[row["name"]]["val_loss"]), rel=2e-3)


@pytest.mark.slow
def test_two_runs_at_a_time_train_the_same_runs(finished_sweep: tuple[Path, Path, str], sweeps: TrainedAhead) -> None:
    """--jobs 2: two runs train side by side, each with half the cores, and every result is the one-at-a-time
    sweep's, bit for bit (a run does not depend on what trains beside it)."""
    _, reference_dir, _ = finished_sweep
    sweep_dir, result = sweeps("two_at_a_time")
    assert f"trained {len(TINY_SHAPES)} runs" in result.stdout, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    started = [index for index, line in enumerate(lines) if line.startswith("[")]
    finished = [index for index, line in enumerate(lines) if line.endswith(" done")]
    assert len(started) == len(finished) == len(TINY_SHAPES)
    assert "(slot 0)" in lines[started[0]] and "(slot 1)" in lines[started[1]]
    assert started[1] < finished[0], "the second run starts before the first ends"
    reference = {row["name"]: row for row in read_results(reference_dir)}
    for row in read_results(sweep_dir):
        assert {key: row[key] for key in COMPARED} == {key: reference[row["name"]][key] for key in COMPARED}


@pytest.mark.slow
def test_a_sweep_stopped_with_ctrl_c_leaves_its_run_interrupted_not_failed(small_dataset: Path, tmp_path: Path):
    """SIGINT to `sweep run` mid-run (Ctrl-C, or a scheduler's stop, to the sweep alone): it stops its trainer
    and ends; the run reads as interrupted, to resume from its checkpoint (`sweep status`: pending), not failed,
    and no trainer is left running."""
    sweep_dir = tmp_path / "sweep"
    spec = tiny_spec(small_dataset, sweep_dir, budgets=[TINY_BUDGETS[1]], models={"shapes": [TINY_SHAPES[2]]})
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    (run,) = plan_sweep(load_sweep_spec(spec_path)).runs
    run_dir = sweep_dir / "runs" / run.name
    # SIGINT at its default, as in a terminal (a shell's background job, CI as `nohup bash .ci/run &`, ignores it)
    sweep = subprocess.Popen([*launcher(1), "sweep", "run", str(spec_path)], cwd=REPO, env=scaletrain_environment(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=default_sigint)
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "latest").exists() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    tree = process_tree(sweep.pid, follow_forks=True)
    # the trainer (the sweep's child, and its fork where warm) is frozen while the stop travels, so the tiny
    # run cannot finish first; it goes on once the sweep has sent it SIGTERM (pending on the frozen process)
    trainers = [pid for pid in tree if pid not in (sweep.pid, fork_of(sweep.pid))]
    for pid in trainers:
        os.kill(pid, signal.SIGSTOP)
    assert trainers and not (run_dir / "summary.json").exists(), "the stop should land mid-run"
    sweep.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while not any(map(_sigterm_pending, trainers)) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in trainers:
        os.kill(pid, signal.SIGCONT)
    assert sweep.wait(timeout=120) != 0
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], run_status(run_dir).state) == ("running", "pending"), status
    assert run_status(run_dir).detail == "interrupted; resumes from its checkpoint"
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if _alive(pid)], "a trainer outlived the sweep"


def _sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to the (stopped) process: bit 15 of its pending-signal masks."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
                return True
    return False


def test_slot_environment_gives_each_job_its_devices_or_its_cores() -> None:
    from scaletrain.scaling.sweep.executors import slot_environment

    assert slot_environment(0, 1, 1, gpus=8, environ={}) == {}  # one job: as before
    assert slot_environment(1, 2, 2, gpus=4, environ={}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert slot_environment(1, 2, 2, gpus=4, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {
        "CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ConfigError, match="--jobs 3 with --nproc 2 needs 6 GPUs, this machine has 4: use --jobs 2"):
        slot_environment(0, 3, 2, gpus=4, environ={})
    assert slot_environment(1, 2, 1, gpus=0, cpus=16, environ={}) == {"OMP_NUM_THREADS": "8"}
    assert slot_environment(1, 4, 2, gpus=0, cpus=2, environ={}) == {"OMP_NUM_THREADS": "1"}
    assert slot_environment(1, 2, 1, gpus=0, cpus=16, environ={"OMP_NUM_THREADS": "3"}) == {}


def test_jobs_refused_below_one_and_with_slurm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(tmp_path / "unprepared", tmp_path / "sweep"))
    assert main(["sweep", "run", str(spec_path), "--jobs", "0"]) == 2
    assert "--jobs 0: give the number of runs to train at once, 1 or more" in capsys.readouterr().err
    assert main(["sweep", "run", str(spec_path), "--executor", "slurm", "--jobs", "2"]) == 2
    assert "--jobs 2: SLURM runs the array's tasks side by side itself" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_finalize_exits_non_zero_when_the_fit_fails_entirely(tmp_path: Path) -> None:
    """Two finished runs of six are too few for any fit: results.csv is written, the reason is one line
    on stderr, and the exit code is 1, so a script or SLURM dependency sees the sweep did not succeed."""
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(tmp_path / "unprepared", tmp_path / "sweep"))
    plan = plan_sweep(load_sweep_spec(spec_path))
    materialize(plan)
    for run, loss in zip(plan.runs[:2], (4.1, 4.0), strict=True):
        (plan.run_dir(run) / "summary.json").write_text(json.dumps(
            {"step": run.steps, "tokens": run.tokens, "flops": run.flops, "val_loss": loss}))
    result = subprocess.run([*launcher(1), "sweep", "finalize", str(plan.directory)], cwd=REPO, capture_output=True,
                            text=True, env=scaletrain_environment(), timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("scaletrain sweep: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "the fit failed (2 of 6 runs done): 2 runs are too few for any fit" in errors[0]
    assert f"the training results stay in {plan.directory / 'results.csv'}" in errors[0]
    assert f"wrote {plan.directory / 'results.csv'}" in result.stdout
    assert [row["status"] for row in read_results(plan.directory)] == ["done"] * 2 + ["pending"] * 4
    assert not (plan.directory / "fit").exists()


def test_a_started_run_resumes_after_an_upgrade_that_added_a_key_but_not_after_a_changed_spec(tmp_path: Path):
    """A run with checkpoints keeps its run.yaml. One written before a section existed (here `eval`, added
    with its defaults while a sweep was training) is the same config to today's code, so the sweep goes
    on; a value the spec no longer gives is refused, naming the run and its file."""
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(tmp_path / "unprepared", tmp_path / "sweep"))
    plan = plan_sweep(load_sweep_spec(spec_path))
    materialize(plan)
    run_dir = plan.run_dir(plan.runs[0])
    (run_dir / "checkpoints").mkdir()
    run_yaml = run_dir / "run.yaml"
    written_before = yaml.safe_load(run_yaml.read_text())
    del written_before["eval"]
    run_yaml.write_text(yaml.safe_dump(written_before, sort_keys=False))
    materialize(plan)
    assert "eval" not in yaml.safe_load(run_yaml.read_text())  # kept as it was written
    written_before["train"]["lr"] *= 2
    run_yaml.write_text(yaml.safe_dump(written_before, sort_keys=False))
    with pytest.raises(ConfigError, match=f"run {plan.runs[0].name} was started with a different config"):
        materialize(plan)
    # a finished run without checkpoints (`sweep restore` puts runs back so) is refused alike
    (run_dir / "checkpoints").rmdir()
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"run {plan.runs[0].name} was started with a different config"):
        materialize(plan)


def test_status_shows_a_running_runs_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A running run shows the latest step its metrics.jsonl logged, of its total, not the total alone;
    a finished run its steps; a run not started 0 of its total. Every run shows the plan's time, and the
    last line the finished run's time against it and the rest of the plan at that rate."""
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(tmp_path / "unprepared", tmp_path / "sweep"))
    plan = plan_sweep(load_sweep_spec(spec_path))
    materialize(plan)
    done, running, pending = plan.runs[:3]
    (plan.run_dir(done) / "summary.json").write_text(json.dumps(
        {"step": done.steps, "tokens": done.tokens, "flops": done.flops, "val_loss": 4.1}))
    write_status_file(plan.run_dir(done), {"state": "done", "wall_s": 2.5 * done.predicted_s})
    # this test's process stands for the trainer: alive, on this host
    write_status_file(plan.run_dir(running), {"state": "running", "pid": os.getpid(), "host": socket.gethostname()})
    logged = running.steps // 3
    records = [{"step": 0, "val_loss": 6.9}, *({"step": step, "loss": 6.0} for step in range(1, logged + 1))]
    lines = [json.dumps(record) for record in records] + ['{"step": ']  # the trainer is writing its next line
    (plan.run_dir(running) / "metrics.jsonl").write_text("\n".join(lines))
    assert main(["sweep", "status", str(plan.directory)]) == 0
    output = capsys.readouterr().out.splitlines()
    printed = {line.split()[0]: line.split()[1:] for line in output[1:-2]}
    assert printed[running.name][:3] == ["running", f"{logged}/{running.steps}", f"{100 * logged // running.steps}%"]
    assert printed[done.name][:2] == ["done", str(done.steps)]
    assert printed[pending.name][:3] == ["pending", f"0/{pending.steps}", "0%"]
    assert printed[done.name][-2:] == [format_duration(2.5 * done.predicted_s), format_duration(done.predicted_s)]
    assert printed[pending.name][-2:] == ["-", format_duration(pending.predicted_s)]
    rest = sum(run.predicted_s for run in plan.runs[1:])
    assert output[-1] == (f"time: 1 finished run took {format_duration(2.5 * done.predicted_s)} against the "
                          f"plan's {format_duration(done.predicted_s)} (2.50x); the unfinished runs are planned at "
                          f"{format_duration(rest)}, about {format_duration(2.5 * rest)} at that rate, one run at a "
                          "time (divide by `--jobs`)")


def test_a_sweep_refuses_to_train_on_other_data_than_its_finished_runs(small_dataset: Path, tmp_path: Path):
    """A sweep restored on a new machine resumes on the corpus rebuilt there, which can differ (the English
    recipe's Debian documentation moved between two machines a day apart). `fit` refuses the mix only after
    the new runs have trained; `sweep run` says it before the first starts, and trains nothing."""
    spec_path = write_spec(tmp_path / "spec.yaml", tiny_spec(small_dataset, tmp_path / "sweep"))
    plan = plan_sweep(load_sweep_spec(spec_path))
    materialize(plan)
    finished = plan.run_dir(plan.runs[0])
    (finished / "summary.json").write_text("{}")
    now = run_data_fingerprint(plan.run_dir(plan.runs[1]))
    assert now is not None
    write_status_file(finished, {"state": "done", "data_fingerprint": now})
    check_one_corpus(plan)  # the same data: nothing to say
    write_status_file(finished, {"state": "done", "data_fingerprint": "0123456789abcdef"})
    with pytest.raises(ConfigError) as refused:
        run_local(plan)
    message = str(refused.value)
    assert f"run {plan.runs[1].name} would train on data with fingerprint {now}" in message
    assert f"0123456789abcdef (run {plan.runs[0].name})" in message and str(small_dataset) in message
    assert not any((plan.run_dir(run) / "train.log").exists() for run in plan.runs)
