"""The training loop: steps, evaluation, logging and checkpoints; parallelism lives elsewhere."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from scaletrain.checkpoint.consolidate import load_full_state_dict
from scaletrain.checkpoint.manager import (
    DIVERGED_DIR,
    CheckpointError,
    CheckpointMeta,
    abandon_pending_save,
    check_files,
    checkpoint_root,
    clean_leftovers,
    complete_checkpoints,
    finish_pending_save,
    flatten_config,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    read_meta,
    resume_candidates,
    save_checkpoint,
    set_aside_from,
)
from scaletrain.checkpoint.safe_load import load_tensors
from scaletrain.config import Config, ConfigError, resolve_for_world, save_config
from scaletrain.model.counts import model_counts
from scaletrain.model.registry import get_family
from scaletrain.parallel.groups import Topology, any_rank, init_distributed, world_size_from_environment
from scaletrain.parallel.peer_loss import RankLost, describe_lost, is_peer_failure
from scaletrain.parallel.placement import (
    RankPlace,
    check_tensor_parallel_within_hosts,
    gather_places,
    hosts_of,
    place_lines,
)
from scaletrain.tracking.durations import format_duration
from scaletrain.tracking.flops import device_peak_flops
from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.engine import build_engine, build_training_model
from scaletrain.train.evaluation import validation_metrics
from scaletrain.train.jit_ops import clear_stale_build_locks
from scaletrain.train.nonfinite import NonFiniteGuard, TrainingDiverged, weights_are_finite
from scaletrain.train.objective import Objective, build_objective
from scaletrain.train.preflight import check_data_matches
from scaletrain.train.run_lock import RunDirectoryBusy, RunDirectoryLock
from scaletrain.train.schedule import learning_rate
from scaletrain.train.step import evaluation_metrics, train_step
from scaletrain.train.stopping import EXIT_STOPPED_EARLY, StopConditions, StopSignals, stop_with_launcher

RUN_SUMMARY_FILE = "summary.json"


@dataclass
class TrainState:
    """Everything that says where a run is; with the engine's state it makes resume exact."""

    step: int = 0
    consumed_samples: int = 0
    stopped_by: str | None = None  # why this invocation stopped before the last step (train/stopping.py)
    resumed_from: str | None = None  # the checkpoint this invocation started from
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite loss or gradient norm
    consecutive_skipped_steps: int = 0


def train(config: Config, stop_signals: StopSignals | None = None) -> TrainState:
    """Train in this process, one rank of the world that torchrun or srun started (or the only one).

    stop_signals: stop handlers the caller installed and keeps (`scaletrain train` does, for the
    whole life of its process: see StopSignals); without them, train installs its own for
    train.stop_signals and restores the previous handlers when it returns.
    """
    signals = StopSignals(config.train.stop_signals) if stop_signals is None else stop_signals
    try:
        stop_with_launcher()  # after the handlers: it may send this process SIGTERM
        config = resolve_for_world(config, world_size_from_environment())
        topology = init_distributed(config)
        places = gather_places(topology)
        check_tensor_parallel_within_hosts(places, topology.tensor_parallel_size)
        check_data_matches(config)
        lock = _lock_run_directory(Path(config.run.dir), topology)
        try:
            return _train_locked(config, topology, places, signals)
        except RuntimeError as error:
            if topology.world_size > 1 and is_peer_failure(error):
                raise RankLost(f"rank {topology.rank} on {places[topology.rank].host}: "
                               f"{describe_lost(error, places, config.parallel.timeout_s, topology.rank)}") from error
            raise
        finally:
            lock.release()
    finally:
        if stop_signals is None:
            signals.restore()


def _train_locked(config: Config, topology: Topology, places: list[RankPlace],
                  stop_signals: StopSignals) -> TrainState:
    # The default generator drives dropout only; TP ranks share a stream so replicated
    # activations get identical masks. Its state is checkpointed per rank.
    torch.manual_seed(config.train.seed + 1000 * topology.pipeline_parallel_rank + topology.data_parallel_rank)
    clear_stale_build_locks()  # before DeepSpeed loads (and maybe JIT-builds) its ops
    candidates = resume_candidates(config)
    model = build_training_model(config, topology)
    if config.train.init_from and not candidates:
        weights = load_tensors(config.train.init_from)
        load_full_state_dict(model, weights, topology.tensor_parallel_rank, topology.tensor_parallel_size)
    engine = build_engine(model, config, topology)
    guard = NonFiniteGuard(engine, topology.device)
    run_dir = Path(config.run.dir)
    state = _restore_or_start(engine, config, topology, run_dir, candidates)
    facts = {**_scaling_facts(config, topology), "hosts": hosts_of(places)}
    if topology.is_logging_rank:
        print(_start_line(config, topology, facts, state), file=sys.stderr, flush=True)
        if topology.world_size > 1:
            print("\n".join(place_lines(places, topology)), file=sys.stderr, flush=True)
    logger = MetricsLogger.for_run(config, run_dir, topology.is_logging_rank, facts, resumed_step=state.step)
    try:
        _run(engine, guard, config, topology, state, logger, stop_signals)
    finally:
        logger.close()
    return state


def _lock_run_directory(run_dir: Path, topology: Topology) -> RunDirectoryLock:
    """Rank 0 holds the run directory's lock; if another process has it, every rank stops."""
    lock = RunDirectoryLock(run_dir)
    busy: RunDirectoryBusy | None = None
    if topology.rank == 0:
        try:
            lock.acquire()
        except RunDirectoryBusy as error:
            busy = error
    if any_rank(busy is not None, topology.device):
        raise ConfigError(str(busy) if busy else f"run.dir={run_dir} is in use by another run")
    return lock


def _run(
    engine: Any, guard: NonFiniteGuard, config: Config, topology: Topology, state: TrainState, logger: MetricsLogger,
    stop_signals: StopSignals,
) -> None:
    global_batch = config.global_batch_size(topology.data_parallel_size)
    tokens_per_step = global_batch * config.model.seq_length
    flops_per_step = model_counts(config).flops_per_token * tokens_per_step
    peak_flops = _cluster_peak_flops(config, topology)
    objective = build_objective(config)
    batches = TimedBatches(_device_batches(
        objective.train_loader(topology.data_parallel_rank, topology.data_parallel_size, state.consumed_samples),
        topology.device,
    ))
    if state.step == 0 and config.train.eval_every:
        logger.log({"step": 0, **evaluate(engine, objective, topology)})
    interactive = sys.stderr.isatty()
    progress = tqdm(
        total=config.train.steps, initial=state.step, disable=not (topology.is_logging_rank and interactive),
        desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
    )
    stop = StopConditions(config.train, stop_signals)
    started = time.perf_counter()
    steps_this_run = 0
    final_metrics: dict[str, float] = {}
    prune_due = True  # older checkpoints are pruned after a finite step (a resumed run's first one)
    try:
        while state.step < config.train.steps:
            step_started = time.perf_counter()
            batches.take_waited()
            guard.start_step(inject_nonfinite_loss=state.step + 1 in config.train.inject_nonfinite_loss_at
                             and topology.data_parallel_rank == 0)
            # The LR is a function of the step and the config as written now, so a resume with a
            # changed train.lr, min_lr, steps or warmup follows the new schedule from this step.
            record = train_step(
                engine, guard, batches, config.train.grad_accum, learning_rate(state.step, config.train))
            elapsed = time.perf_counter() - step_started
            state.step += 1
            state.consumed_samples += global_batch  # a skipped step consumes its batch too (as Megatron's)
            state.skipped_steps += guard.skipped
            state.consecutive_skipped_steps = state.consecutive_skipped_steps + 1 if guard.skipped else 0
            steps_this_run += 1
            record.update(step=state.step, tokens=state.step * tokens_per_step, step_time_s=elapsed,
                          tokens_per_s=tokens_per_step / elapsed, skipped_steps=state.skipped_steps,
                          data_wait_fraction=batches.take_waited() / elapsed)
            if peak_flops:
                record["mfu"] = flops_per_step / elapsed / peak_flops
            logger.log(record)
            if topology.is_logging_rank and not interactive and _log_line_due(state.step, steps_this_run, config):
                # SLURM and CI logs: a plain line every log_every steps, no carriage returns
                print(_log_line(record, config.train.steps, time.perf_counter() - started, steps_this_run),
                      file=sys.stderr, flush=True)
            _stop_if_diverged(config, topology, state)
            if prune_due and not guard.skipped:
                _prune(config, topology)  # the step after the newest checkpoint trained finitely
                prune_due = False
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            finished = state.step == config.train.steps
            # Every run ends with an evaluation, so its final validation loss is always measured
            # on the same fixed set (scaling-law fits read it).
            if config.train.eval_every and (state.step % config.train.eval_every == 0 or finished):
                metrics = evaluate(engine, objective, topology)
                logger.log({"step": state.step, **metrics})
                if topology.is_logging_rank:
                    progress.write(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                if finished:
                    final_metrics = metrics
            state.stopped_by = None if finished else stop.poll(steps_this_run, topology.device)
            if (state.step % config.checkpoint.every == 0 or state.step in config.checkpoint.keep_steps
                    or state.stopped_by or finished):
                prune_due = _save_finite_checkpoint(engine, config, topology, state) or prune_due
            if finished and prune_due:
                _prune(config, topology)
            if finished and topology.is_logging_rank:
                write_run_summary(Path(config.run.dir), state, tokens_per_step, flops_per_step, final_metrics)
            if state.stopped_by:
                break
        finish_pending_save()  # the last checkpoint is published before the run reports it
    except BaseException:
        abandon_pending_save()  # a lost rank may never agree on it; the next start removes its files
        raise
    finally:
        progress.close()
    if topology.is_logging_rank:
        _report_end(config, state, tokens_per_step, time.perf_counter() - started, final_metrics)


def _stop_if_diverged(config: Config, topology: Topology, state: TrainState) -> None:
    """Every rank counts the same skips, so every rank stops at the same step."""
    limit = config.train.max_skipped_steps
    if state.consecutive_skipped_steps < limit:
        return
    first = state.step - state.consecutive_skipped_steps + 1
    raise TrainingDiverged(
        f"training diverged: the loss or gradient norm was non-finite at {limit} steps in a row (steps "
        f"{first}-{state.step}, train.max_skipped_steps={limit}); their updates were skipped and the run "
        f"stopped at step {state.step}. {_set_aside_blown_up(config, topology, blown_up_at=first - 1)}"
    )


def _save_finite_checkpoint(engine: Any, config: Config, topology: Topology, state: TrainState) -> bool:
    """A checkpoint, unless any rank's weights are non-finite: then the run stops. One written during
    a streak of skipped steps holds the weights from before the streak (skips change nothing); if the
    streak ends the run, it is set aside with them (_set_aside_blown_up). Returns whether one was written."""
    if not weights_are_finite(engine.module, topology.device):
        raise TrainingDiverged(
            f"training diverged: the weights are non-finite after step {state.step}; no checkpoint was "
            f"saved. {_set_aside_blown_up(config, topology, blown_up_at=state.step)}"
        )
    save_checkpoint(engine, config, topology, state.step, state.consumed_samples, state.skipped_steps,
                    state.consecutive_skipped_steps)
    return True


def _prune(config: Config, topology: Topology) -> None:
    if topology.rank == 0:
        prune_checkpoints(Path(config.run.dir), config.checkpoint.keep_last, config.checkpoint.keep_steps)


def _set_aside_blown_up(config: Config, topology: Topology, blown_up_at: int) -> str:
    """After a divergence whose bad update was step `blown_up_at`: the checkpoints from that step on
    hold blown-up weights, so rank 0 moves them to checkpoints/diverged/, and resuming (train.resume=
    auto) starts from the newest one before it. The sentence that tells the user so."""
    run_dir = Path(config.run.dir)
    finish_pending_save()  # every rank stops here together: the checkpoint in flight is published first
    moved = set_aside_from(run_dir, blown_up_at) if topology.rank == 0 else []
    aside = (f"The update of step {blown_up_at} blew up the weights; checkpoints from it on were moved to "
             f"{checkpoint_root(run_dir) / DIVERGED_DIR} ({', '.join(p.name for p in moved)}). " if moved else "")
    good = [path for path in complete_checkpoints(run_dir) if int(path.name.removeprefix("step_")) < blown_up_at]
    if not good:
        return (f"{aside}No checkpoint was saved before step {blown_up_at}: lower train.lr (or raise "
                "train.warmup_steps) and run the same command again; it starts over.")
    return (f"{aside}The last good checkpoint is {good[-1]}: lower train.lr (or raise train.warmup_steps) and "
            f"run the same command again to resume from it (train.resume=auto).")


def _log_line_due(step: int, steps_this_run: int, config: Config) -> bool:
    """Every train.log_every steps (Megatron's --log-interval), and the first step of an invocation (it
    shows the run is training and how fast) and the last one (the run's final loss)."""
    return step % config.train.log_every == 0 or steps_this_run == 1 or step == config.train.steps


def _log_line(record: dict[str, float], total_steps: int, elapsed_s: float, steps_this_run: int) -> str:
    """The plain progress line; the ETA is this invocation's mean step time so far (evaluations and
    checkpoints included, as the steps left will have them) times the steps left."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}"]
    if "grad_norm" in record:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    eta_s = elapsed_s / steps_this_run * (total_steps - record["step"])
    parts.extend([f"elapsed {format_duration(elapsed_s)}", f"eta {format_duration(eta_s)}"])
    return "train: " + ", ".join(parts)


def _report_end(
    config: Config, state: TrainState, tokens_per_step: int, wall_s: float, final_metrics: dict[str, float]
) -> None:
    latest = latest_checkpoint(Path(config.run.dir))
    if state.stopped_by:
        print(f"stopped early ({state.stopped_by}) at step {state.step}/{config.train.steps} after {wall_s:.0f} s; "
              f"checkpoint {latest}; run the same command again to resume (exit code {EXIT_STOPPED_EARLY})",
              file=sys.stderr)
        return
    val = ", ".join(f"{key} {value:.4f}" for key, value in final_metrics.items()) or "no evaluation (eval_every=0)"
    print(f"finished: {state.step} steps, {state.step * tokens_per_step:,} tokens, {wall_s:.0f} s in this "
          f"invocation; final {val}; checkpoint {latest}", file=sys.stderr)


def write_run_summary(
    run_dir: Path, state: TrainState, tokens_per_step: int, flops_per_step: float, metrics: dict[str, float]
) -> None:
    """RUN_DIR/summary.json, written once a run has trained all its steps: what sweeps and scripts
    read to tell a finished run and its final validation metrics (written atomically)."""
    summary = {"step": state.step, "consumed_samples": state.consumed_samples,
               "tokens": state.step * tokens_per_step, "flops": state.step * flops_per_step, **metrics}
    staging = run_dir / f".{RUN_SUMMARY_FILE}.tmp"
    staging.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(staging, run_dir / RUN_SUMMARY_FILE)


def evaluate(engine: Any, objective: Objective, topology: Topology) -> dict[str, float]:
    """The engine's validation metrics (train/evaluation.py: which sequences, a blend's weighting)."""
    family = get_family(objective.config.model.family)
    return validation_metrics(lambda batches: evaluation_metrics(engine, batches, family), objective, topology)


def _restore_or_start(
    engine: Any, config: Config, topology: Topology, run_dir: Path, candidates: list[Path]
) -> TrainState:
    """Resume from the first of `candidates` (manager.resume_candidates) that loads, naming any that
    did not, or start at step 0. Every rank takes the same checkpoint: a failure on any rank skips
    it on all. A refused reshard stops the run instead of quietly falling back to an older checkpoint,
    and so does a checkpoint of another model shape: the config changed, not the checkpoint."""
    if topology.rank == 0:
        for leftover in clean_leftovers(run_dir):
            print(f"removed {leftover}: left by a save or prune that was killed", file=sys.stderr)
    for index, path in enumerate(candidates):
        error = None
        try:
            meta = _load_any_layout(engine, path, config, topology)
        except CheckpointError as failure:
            error = failure
        reason = _first_failure(error, topology)
        if reason is None:
            if path == _branch_point(config) and topology.is_logging_rank:
                _write_run_config(config, run_dir)  # a branch starts its run directory here
            return TrainState(step=meta.step, consumed_samples=meta.consumed_samples, resumed_from=str(path),
                              skipped_steps=meta.skipped_steps,
                              consecutive_skipped_steps=meta.consecutive_skipped_steps)
        _refuse_another_shape(path, config)
        if index + 1 == len(candidates):
            raise CheckpointError(
                f"no checkpoint of {run_dir} could be loaded; the last tried: {reason}. Delete the broken "
                "checkpoints (or set train.resume=never to start over)"
            )
        if topology.is_logging_rank:
            print(f"warning: skipping checkpoint {path}: {reason}; trying {candidates[index + 1]}", file=sys.stderr)
    if topology.is_logging_rank:
        _write_run_config(config, run_dir)
    return TrainState()


def _first_failure(error: CheckpointError | None, topology: Topology) -> str | None:
    """The lowest failing rank's reason on every rank (None when every rank loaded), so the warning
    says why even when only a rank that does not log failed (a file only it reads)."""
    reasons: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(reasons, str(error) if error else None)
    return next((f"{reason} (rank {rank})" if topology.world_size > 1 else reason
                 for rank, reason in enumerate(reasons) if reason), None)


# Keys that fix the shapes of the weights and optimizer state: a checkpoint loads only into the same.
SHAPE_KEYS = ("model.", "data.vocab_size", "data.num_sentinels")


def _refuse_another_shape(path: Path, config: Config) -> None:
    """A checkpoint that failed to load and was trained with other shape keys than this config's:
    one error listing them and both ways on (every rank reads the same files, so all raise it)."""
    stored_config = path / "config.yaml"
    if not stored_config.is_file():
        return
    try:
        stored = flatten_config(yaml.safe_load(stored_config.read_text()))
    except (OSError, yaml.YAMLError):
        return
    ours = flatten_config(config.to_dict())
    differing = [f"{key}: {stored.get(key)!r} there, {ours.get(key)!r} here" for key in sorted(set(ours) | set(stored))
                 if key.startswith(SHAPE_KEYS) and key in stored and stored.get(key) != ours.get(key)]
    if differing:
        raise ConfigError(
            f"checkpoint {path} holds another model than this config builds ({'; '.join(differing)}). Set these "
            f"back as the run had them ({stored_config}) to resume it, or train this config from scratch with "
            f"train.resume=never or a new run.dir"
        )


def _branch_point(config: Config) -> Path | None:
    return Path(config.train.branch_from) if config.train.branch_from else None


def _write_run_config(config: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")


def _load_any_layout(engine: Any, path: Path, config: Config, topology: Topology) -> CheckpointMeta:
    """Any layout's checkpoint, cut for this run's (checkpoint/layout_free.py)."""
    meta = read_meta(path)
    check_files(path, meta)
    load_checkpoint(engine, path, meta, config, topology)
    return meta


def _device_batches(loader: Any, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for batch in loader:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


class TimedBatches:
    """The training batches, counting the wall time a step spends waiting for the next one: the
    loader (its workers, tokenization-free packed reads, collation) is off the critical path when
    `data_wait_fraction` in metrics.jsonl stays near 0."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]) -> None:
        self._batches = batches
        self.waited_s = 0.0

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.waited_s += time.perf_counter() - started

    def take_waited(self) -> float:
        waited, self.waited_s = self.waited_s, 0.0
        return waited


def _scaling_facts(config: Config, topology: Topology) -> dict[str, float]:
    """N, D and C of the whole run (Kaplan et al. 2020 notation) and the layout's derived sizes,
    for the tracker's run config."""
    counts = model_counts(config)
    global_batch = config.global_batch_size(topology.data_parallel_size)
    tokens = config.train.steps * global_batch * config.model.seq_length
    return {"params": counts.total_params, "non_embedding_params": counts.non_embedding_params,
            "flops_per_token": counts.flops_per_token, "tokens": tokens, "flops": tokens * counts.flops_per_token,
            "world_size": topology.world_size, "data_parallel_size": topology.data_parallel_size,
            "global_batch_size": global_batch, "tokens_per_step": global_batch * config.model.seq_length}


def _start_line(config: Config, topology: Topology, facts: dict[str, Any], state: TrainState) -> str:
    resumed = f"resuming at step {state.step} from {state.resumed_from}" if state.resumed_from else "starting at step 0"
    return (f"train: {config.model.family}, {facts['params']:,} parameters ({facts['non_embedding_params']:,} "
            f"non-embedding); world {topology.world_size} = TP {topology.tensor_parallel_size} x "
            f"DP {topology.data_parallel_size} x PP {topology.pipeline_parallel_size}, "
            f"ZeRO-{config.parallel.zero_stage}; "
            f"global batch {facts['global_batch_size']} x {config.model.seq_length} = {facts['tokens_per_step']:,} "
            f"tokens per step, {config.train.steps} steps; {resumed}; run dir {config.run.dir}")


def _cluster_peak_flops(config: Config, topology: Topology) -> float | None:
    name = torch.cuda.get_device_name() if topology.device.type == "cuda" else "cpu"
    peak = device_peak_flops(name, config.tracking.peak_tflops)
    return peak * topology.world_size if peak else None

