"""Train a sweep's runs: in this process's machine one after another (`local`, `torchrun`), or as a
SLURM job array (`slurm`). Every executor ends up in `run_one`, which trains one run directory
and records how it went, so a sweep can be stopped and re-run at any point: finished runs are
skipped, interrupted ones resume exactly from their checkpoints (train.resume=auto).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import yaml

from scaletrain.config import Config, ConfigError, save_config
from scaletrain.config_loader import load_config
from scaletrain.scaling.sweep.layout import PLAN_FILE, RUN_CONFIG_FILE, RUNS_DIR, SWEEP_FILE, TRAIN_LOG
from scaletrain.scaling.sweep.plan import PlannedRun, SweepPlan
from scaletrain.scaling.sweep.results import read_status_file, run_data_fingerprint, run_status, write_status_file

# The trainer processes this process started and that still run (local jobs run in threads): stopped together
# when the sweep is interrupted.
_TRAINERS: set[subprocess.Popen] = set()
_TRAINERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class LocalOutcome:
    trained: list[str]
    skipped: list[str]  # finished before this invocation
    failed: list[str]


def materialize(plan: SweepPlan) -> None:
    """Write SWEEP/sweep.json, SWEEP/plan.json and each run's full config, RUN/run.yaml.

    A run that already has checkpoints, or has finished (also one `sweep restore` put back without its
    checkpoints), keeps its config: a changed spec would otherwise resume it under different settings, or
    count its result as the new spec's, so that is refused with the run's name. The stored config is read
    as today's code reads it, so a key added to scaletrain since (its default filled in) is no change:
    a sweep started before an upgrade resumes under it.
    """
    sweep_dir = plan.directory
    sweep_dir.mkdir(parents=True, exist_ok=True)
    for run in plan.runs:
        config = load_config(plan.spec.base, [*plan.spec.overrides, *run.overrides])
        run_dir = plan.run_dir(run)
        path = run_dir / RUN_CONFIG_FILE
        if path.is_file() and ((run_dir / "checkpoints").is_dir() or run_status(run_dir).state == "done"):
            if _as_read_now(path) != _as_yaml(config):
                raise ConfigError(
                    f"sweep {plan.spec.name}: run {run.name} was started with a different config "
                    f"({path}); the spec changed since. Use a new sweep `dir`, or delete {run_dir} to retrain it"
                )
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, path)
    _write_json(sweep_dir / SWEEP_FILE, {"spec": plan.spec.to_dict(), "working_dir": os.getcwd()})
    _write_json(sweep_dir / PLAN_FILE, {"tokens_per_step": plan.tokens_per_step, "train_tokens": plan.train_tokens,
                                        "runs": [run.to_row() for run in plan.runs]})


def check_one_corpus(plan: SweepPlan) -> None:
    """Refuse to train more of a sweep's runs on other data than its finished runs recorded.

    A sweep restored on a new machine resumes on the corpus rebuilt there, and a rebuilt corpus can differ
    (a package moved since: the English recipe's Debian documentation did, 2026-11-29), as can one re-prepared
    with other settings. `fit` refuses the mix of fingerprints, but only after the new runs have trained;
    this says it before the first one starts, naming a finished run and the data to restore.
    """
    recorded: dict[str, str] = {}
    pending = []
    for run in plan.runs:
        run_dir = plan.run_dir(run)
        if run_status(run_dir).state == "done":
            fingerprint = read_status_file(run_dir).get("data_fingerprint")
            if fingerprint:
                recorded.setdefault(fingerprint, run.name)
        else:
            pending.append(run)
    if not recorded:
        return
    for run in pending:
        now = run_data_fingerprint(plan.run_dir(run))
        if now is not None and now not in recorded:
            finished = ", ".join(f"{fingerprint} (run {name})" for fingerprint, name in recorded.items())
            raise ConfigError(
                f"sweep {plan.spec.name}: run {run.name} would train on data with fingerprint {now}, but the "
                f"sweep's finished runs recorded {finished}: the corpus at {_data_dirs(plan.run_dir(run))} is "
                "not the one they trained on. Rebuild it as it was (the same sources and `prepare` settings), "
                "or use a new sweep `dir`")


def _data_dirs(run_dir: Path) -> str:
    config = load_config(run_dir / RUN_CONFIG_FILE, [], to_train=False)
    return ", ".join(str(source.dir) for source in config.data.sources())


def _as_yaml(config: Config) -> dict:
    return yaml.safe_load(yaml.safe_dump(config.to_dict(), sort_keys=False))


def _as_read_now(path: Path) -> dict:
    """RUN/run.yaml as a config today's code loads (defaults filled in), or as written where it no longer loads."""
    try:
        return _as_yaml(load_config(path, [], to_train=False))
    except ConfigError:
        return yaml.safe_load(path.read_text())


def run_one(run_dir: Path, nproc: int = 1, nodes: int = 1, environment: dict[str, str] | None = None) -> int:
    """Train (or resume) one run directory; record running/done/failed and the wall time in RUN/status.json.

    With nproc > 1 the run goes through torchrun on this node; with nodes > 1 (inside a SLURM job of
    that many nodes) srun starts nproc ranks on each. Output goes to RUN/train.log. `environment`: variables
    set for the trainer (a local job slot's devices and threads, slot_environment).
    """
    if nodes > 1 and "SLURM_JOB_ID" not in os.environ:
        raise ConfigError(f"--nodes {nodes}: a run spans several nodes only inside a SLURM job of that many "
                          "(`sweep run --executor slurm` with slurm.nodes); run it with --nodes 1 here")
    status = read_status_file(run_dir)
    attempts = status.get("attempts", 0) + 1
    wall_s = status.get("wall_s") or 0.0
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    slurm_job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else status.get("slurm_job")
    write_status_file(run_dir, {"state": "running", "pid": os.getpid(), "host": socket.gethostname(),
                                "attempts": attempts, "wall_s": wall_s, "slurm_job": slurm_job})
    started = time.monotonic()
    returncode = _train_process(run_dir, nproc, nodes, environment or {})
    wall_s += time.monotonic() - started
    done = returncode == 0 and run_status(run_dir).state == "done"
    # the data as the run ends: a corpus re-prepared later must not relabel this run's loss
    fingerprint = run_data_fingerprint(run_dir) if done else None
    write_status_file(run_dir, {"state": "done" if done else "failed", "returncode": returncode,
                                "attempts": attempts, "wall_s": round(wall_s, 3), "slurm_job": slurm_job,
                                "data_fingerprint": fingerprint})
    return 0 if done else (returncode or 1)


def _train_process(run_dir: Path, nproc: int, nodes: int, extra_environment: dict[str, str]) -> int:
    environment = {**os.environ, **extra_environment}
    if nodes > 1:  # as launch/slurm.sbatch: one srun task per rank, node by node, the first node the master
        launcher = ["srun", "--kill-on-bad-exit=0", "--wait=120", f"--nodes={nodes}", f"--ntasks-per-node={nproc}",
                    f"--ntasks={nodes * nproc}", "--distribution=block", sys.executable]
        environment.update(MASTER_ADDR=_first_node(), MASTER_PORT=str(15000 + int(os.environ["SLURM_JOB_ID"]) % 15000))
    elif nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        launcher = [sys.executable]
    command = [*launcher, "-m", "scaletrain", "train", str(run_dir / RUN_CONFIG_FILE)]
    with (run_dir / TRAIN_LOG).open("a") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        with _TRAINERS_LOCK:
            _TRAINERS.add(process)
        try:
            return process.wait()
        finally:
            if process.poll() is None:  # we were interrupted: do not leave the trainer behind
                process.terminate()
                process.wait()
            with _TRAINERS_LOCK:
                _TRAINERS.discard(process)


def _first_node() -> str:
    """The first host of this SLURM job (scontrol expands SLURM_JOB_NODELIST's ranges)."""
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True, timeout=60).stdout.split()
    return hosts[0]


def run_local(plan: SweepPlan, nproc: int = 1, log: callable = print, jobs: int = 1) -> LocalOutcome:
    """Train every unfinished run on this machine, `jobs` at a time, each in its slot's devices and threads
    (slot_environment); a failed run is recorded and the others go on. Runs start in execution_order (a ladder:
    each stable run, then its branches); a branch waits for its stable run and fails if that did not finish.
    Every run is the same whatever else trains beside it (data order and initial weights follow from its
    seed), so `jobs` changes the wall time, not the results."""
    materialize(plan)
    check_one_corpus(plan)
    trained, skipped, failed = [], [], []
    order = execution_order(plan.runs)
    position = {run.name: index for index, run in enumerate(order, start=1)}
    waiting = []
    for run in order:
        status = run_status(plan.run_dir(run))
        if status.state == "done":
            skipped.append(run.name)
        elif status.state in ("running", "queued"):
            raise ConfigError(f"run {run.name} is {status.state} elsewhere ({status.detail}); "
                              "wait for it or stop it before running the sweep here")
        else:
            waiting.append(run)
    environments = [slot_environment(slot, jobs, nproc) for slot in range(jobs)]  # refused before any run starts
    slots = list(range(jobs))
    training: dict[Future, tuple[PlannedRun, int]] = {}
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        while waiting or training:
            unfinished = {run.name for run in waiting} | {run.name for run, _ in training.values()}
            for run in [run for run in waiting if run.stable_run not in unfinished or run.role != "branch"]:
                if not slots:
                    break
                waiting.remove(run)
                run_dir = plan.run_dir(run)
                reason = _unfinished_stable_run(plan, run)
                if reason:
                    write_status_file(run_dir, {**read_status_file(run_dir), "state": "failed", "reason": reason})
                    failed.append(run.name)
                    log(f"[{position[run.name]}/{len(order)}] {run.name} failed: {reason}")
                    continue
                slot = slots.pop(0)
                log(f"[{position[run.name]}/{len(order)}] {run.name}: {run.steps} steps, {run.tokens:,} tokens, "
                    f"{run.flops:.3g} FLOPs" + (" (resuming)" if (run_dir / "checkpoints").is_dir() else "") +
                    (f" (slot {slot})" if jobs > 1 else ""))
                training[pool.submit(run_one, run_dir, nproc, 1, environments[slot])] = (run, slot)
            if not training:
                continue
            finished, _ = wait(training, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=lambda future: position[training[future][0].name]):
                run, slot = training.pop(future)
                slots.append(slot)
                if future.result() == 0:
                    trained.append(run.name)
                    if jobs > 1:
                        log(f"    {run.name} done")
                else:
                    failed.append(run.name)
                    log(f"    {run.name} failed: see {plan.run_dir(run) / TRAIN_LOG}")
    except BaseException:
        # interrupted: stop the runs in flight and record them as interrupted, not failed (their threads saw
        # the trainer end); each resumes from its checkpoint next time
        _stop_trainers()
        pool.shutdown(wait=True)
        for run, _ in training.values():
            _record_interrupted(plan.run_dir(run))
        raise
    finally:
        pool.shutdown(wait=True)
    return LocalOutcome(trained, skipped, failed)


def _record_interrupted(run_dir: Path) -> None:
    """RUN/status.json as an interrupted run's: `running` under this process, which is ending, so run_status
    reads it as pending, to resume from its checkpoint, as the one-at-a-time sweep left an interrupted run."""
    status = read_status_file(run_dir)
    if status.get("state") == "failed" and run_status(run_dir).state != "done":
        write_status_file(run_dir, {**status, "state": "running", "pid": os.getpid(), "host": socket.gethostname()})


def slot_environment(slot: int, jobs: int, nproc: int, gpus: int | None = None, cpus: int | None = None,
                     environ: dict[str, str] | None = None) -> dict[str, str]:
    """What a run of local job slot `slot` (of `jobs`) is started with, so that runs side by side do not share
    devices or oversubscribe the cores: on a machine with GPUs, its `nproc` of them (CUDA_VISIBLE_DEVICES:
    slot 1 of 4 single-GPU runs gets device 1); without, OMP_NUM_THREADS = the cores over jobs x nproc, unless
    the environment sets it. One job changes nothing."""
    if jobs == 1:
        return {}
    environ = os.environ if environ is None else environ
    gpus = _visible_gpus() if gpus is None else gpus
    if gpus:
        if jobs * nproc > gpus:
            raise ConfigError(f"--jobs {jobs} with --nproc {nproc} needs {jobs * nproc} GPUs, this machine has {gpus}: "
                              f"use --jobs {max(1, gpus // nproc)} or fewer")
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(index) for index in range(gpus)]
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices[slot * nproc:(slot + 1) * nproc])}
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (cpus or os.cpu_count() or 1) // (jobs * nproc)))}


def _visible_gpus() -> int:
    import torch  # the trainers' own import; here only to count the devices

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _stop_trainers() -> None:
    with _TRAINERS_LOCK:
        running = list(_TRAINERS)
    for process in running:
        if process.poll() is None:
            process.terminate()


def execution_order(runs: list[PlannedRun]) -> list[PlannedRun]:
    """The plan's runs with each ladder branch moved up behind its stable run (the plan lists every stable run
    first, as SLURM submits them in waves). One size at a time, a stable run's checkpoints are needed only until
    its last branch has run: a sweep stopped on a machine that does not last (`sweep archive`) loses at most one
    stable run's progress, and the checkpoints of the sizes done can be deleted while the sweep goes on."""
    stables = {run.name for run in runs if run.role == "stable"}
    ordered = []
    for run in runs:
        if run.role == "branch" and run.stable_run in stables:
            continue  # placed behind its stable run
        ordered.append(run)
        if run.role == "stable":
            ordered.extend(branch for branch in runs if branch.role == "branch" and branch.stable_run == run.name)
    return ordered


def _unfinished_stable_run(plan: SweepPlan, run: PlannedRun) -> str | None:
    """Why a ladder branch cannot start: its stable run is not done (None: it is, or this is no branch)."""
    if run.role != "branch":
        return None
    stable_dir = plan.directory / RUNS_DIR / run.stable_run
    status = run_status(stable_dir)
    if status.state == "done":
        return None
    return (f"its stable run {run.stable_run} is {status.state} ({status.detail or 'no summary.json'}); fix and "
            "re-run the sweep: the stable run resumes, then its branches start")


def submit_slurm(plan: SweepPlan, nproc: int, spec_path: Path) -> str:
    """Write an sbatch job array with one task per unfinished run, submit it and a dependent
    finalize job (results, fit, W&B summary), and return what was submitted."""
    materialize(plan)
    check_one_corpus(plan)
    states = {run.name: run_status(plan.run_dir(run)).state for run in plan.runs}
    busy = [name for name, state in states.items() if state in ("running", "queued")]
    if busy:
        raise ConfigError(f"runs {', '.join(busy)} are still queued or running in SLURM; wait for them "
                          "(`scaletrain sweep status`) before submitting again")
    todo = [run for run in plan.runs if states[run.name] != "done"]
    if not todo:
        return f"all {len(plan.runs)} runs of {plan.spec.name} are done; nothing to submit"
    slurm_dir = (plan.directory / "slurm").resolve()
    slurm_dir.mkdir(parents=True, exist_ok=True)
    arrays = _submit_arrays(plan, todo, nproc, slurm_dir)
    jobs = [job for job, _ in arrays]
    finalize = _sbatch([
        "--parsable", f"--dependency=afterany:{':'.join(jobs)}", f"--job-name=sweep-{plan.spec.name}-finalize",
        f"--output={slurm_dir}/%x-%j.out", "--ntasks=1", "--cpus-per-task=1",
        *([f"--partition={plan.spec.slurm.partition}"] if plan.spec.slurm.partition else []),
        f"--wrap=cd {shlex.quote(os.getcwd())} && {shlex.quote(sys.executable)} -m scaletrain sweep finalize "
        f"{shlex.quote(str(spec_path.resolve()))}",
    ])
    submitted = "; ".join(f"job array {job} ({len(runs)} runs)" for job, runs in arrays)
    return (f"submitted {submitted}, at most {plan.spec.slurm.max_concurrent} at once (scripts in {slurm_dir}), "
            f"and finalize job {finalize}; follow it with `scaletrain sweep status {spec_path}`")


def _submit_arrays(
    plan: SweepPlan, todo: list[PlannedRun], nproc: int, slurm_dir: Path
) -> list[tuple[str, list[PlannedRun]]]:
    """One job array of the runs; in a ladder, one of the stable runs and one of the branches that starts
    once every stable run succeeded (afterok; --kill-on-invalid-dep drops it if one failed, instead of
    leaving it pending forever). Each run's status.json records its array task."""
    stables = [run for run in todo if run.role == "stable"]
    waves = [(stables, "stable"), ([run for run in todo if run.role != "stable"], "branches")] if stables else [
        (todo, "")]
    stamp, arrays = time.strftime("%Y%m%d-%H%M%S"), []
    for runs, part in (wave for wave in waves if wave[0]):
        script = slurm_dir / f"array-{stamp}{'-' + part if part else ''}.sbatch"
        script.write_text(array_script(plan, runs, nproc, slurm_dir))
        after = [f"--dependency=afterok:{arrays[-1][0]}", "--kill-on-invalid-dep=yes"] if arrays else []
        job = _sbatch(["--parsable", *after, str(script)])
        for index, run in enumerate(runs):
            status = read_status_file(plan.run_dir(run))
            write_status_file(plan.run_dir(run), {**status, "state": "queued", "slurm_job": f"{job}_{index}"})
        arrays.append((job, runs))
    return arrays


def array_script(plan: SweepPlan, runs: list[PlannedRun], nproc: int, slurm_dir: Path) -> str:
    """The job array, following launch/slurm.sbatch. One node per run: one srun task per run, torchrun
    inside for nproc > 1. Several (slurm.nodes): each task is a multi-node job whose run-one, in the
    batch script, starts nproc ranks per node with srun."""
    slurm = plan.spec.slurm
    several = slurm.nodes > 1
    threads = max(1, slurm.cpus_per_task // nproc)  # each rank's share of the run's CPUs on a node
    tasks = [f"--ntasks-per-node={nproc}", f"--cpus-per-task={threads}"] if several else [
        "--ntasks-per-node=1", f"--cpus-per-task={slurm.cpus_per_task}"]
    options = [
        f"--job-name=sweep-{plan.spec.name}", f"--array=0-{len(runs) - 1}%{slurm.max_concurrent}",
        f"--nodes={slurm.nodes}", *tasks, f"--time={slurm.time}",
        f"--output={slurm_dir}/%x-%A_%a.out",
        *([f"--gpus-per-node={slurm.gpus_per_task}"] if slurm.gpus_per_task else []),
        *([f"--partition={slurm.partition}"] if slurm.partition else []), *slurm.extra_args,
    ]
    run_dirs = "\n".join(f"  {shlex.quote(str(plan.run_dir(run).resolve()))}" for run in runs)
    run_one = (f"{shlex.quote(sys.executable)} -m scaletrain sweep run-one \"${{RUN_DIRS[$SLURM_ARRAY_TASK_ID]}}\" "
               f"--nproc {nproc}")
    launch = f"{run_one} --nodes {slurm.nodes}" if several else f"srun --kill-on-bad-exit=1 {run_one}"
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Written by `scaletrain sweep run --executor slurm` for sweep {plan.spec.name}: one array task per",
        "# unfinished run. Each task trains (or resumes) its run directory and records the outcome there.",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        f"RUN_DIRS=(\n{run_dirs}\n)",
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}",
        launch,
        "",
    ])


def _sbatch(arguments: list[str]) -> str:
    try:
        result = subprocess.run(["sbatch", *arguments], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError("--executor slurm needs SLURM's `sbatch` on PATH; run on a login node of your "
                          "cluster, or use --executor local / torchrun") from None
    if result.returncode != 0:
        raise ConfigError(f"sbatch refused the job: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip().split(";")[0]


def _write_json(path: Path, payload: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(staging, path)
