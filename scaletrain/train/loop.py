"""The training loop: start or resume a run, then step; side concerns are hooks (train/hooks/)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.checkpoint.consolidate import load_full_state_dict
from scaletrain.checkpoint.divergence import set_aside_rejected
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import CheckpointMeta, check_files, checkpoint_root, complete_checkpoints, read_meta
from scaletrain.checkpoint.init_weights import check_init_from, load_init_weights
from scaletrain.checkpoint.manager import load_checkpoint
from scaletrain.checkpoint.publishing import (
    abandon_pending_save,
    clean_leftovers,
    finish_pending_save,
    pending_save_failed,
)
from scaletrain.checkpoint.resume_policy import (
    Resumption,
    checkpoint_provenance,
    resume_candidates,
    resume_rules,
    resumption_from,
)
from scaletrain.config import Config, ConfigError, save_config
from scaletrain.families import model_counts
from scaletrain.parallel.groups import (
    Topology,
    any_rank,
    init_distributed,
    resolve_precision,
    world_size_from_environment,
)
from scaletrain.parallel.layout import resolve_for_world
from scaletrain.parallel.peer_loss import is_peer_failure, rank_lost
from scaletrain.parallel.placement import (
    RankPlace,
    check_tensor_parallel_within_hosts,
    gather_places,
    hosts_of,
    place_lines,
)
from scaletrain.planner.recompute import RecomputeDecision, device_memory, resolve_recompute
from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.engine import build_engine
from scaletrain.train.hooks import Hooks, build_hooks
from scaletrain.train.hooks.checkpointing import set_aside_blown_up
from scaletrain.train.hooks.speed import TimedBatches
from scaletrain.train.hooks.summary import RUN_SUMMARY_FILE as RUN_SUMMARY_FILE  # noqa: F401 (sweeps read it here)
from scaletrain.train.jit_ops import clear_stale_build_locks
from scaletrain.train.nonfinite import NonFiniteGuard, TrainingDiverged
from scaletrain.train.objective import build_objective
from scaletrain.train.parallelize import build_training_model
from scaletrain.train.preflight import check_checkpoints_writable, check_data_matches, describe_resume
from scaletrain.train.run_lock import RunDirectoryBusy, RunDirectoryLock, RunDirectoryStart
from scaletrain.train.schedule import learning_rate
from scaletrain.train.spikes import LossSpikes, Rewind
from scaletrain.train.state import TrainState
from scaletrain.train.step import train_step
from scaletrain.train.stopping import (
    SAVE_FAILED,
    StopConditions,
    StoppedWaitingForData,
    StopSignals,
    stop_with_launcher,
)


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
        # auto recomputation is decided here, once, from the GPU's memory (planner/recompute.py)
        config, recompute = resolve_recompute(config, device_memory(topology.device))
        places = gather_places(topology)
        check_tensor_parallel_within_hosts(places, topology.tensor_parallel_size)
        tokenizer_sha256 = check_data_matches(config).tokenizer_sha256
        _check_checkpoints_writable(Path(config.run.dir), topology)
        check_init_from(config)  # before the run directory is made
        start = RunDirectoryStart(Path(config.run.dir))
        lock = _lock_run_directory(Path(config.run.dir), topology)
        try:
            return _train_locked(config, topology, places, signals, recompute, start, tokenizer_sha256)
        except RuntimeError as error:
            if topology.world_size > 1 and is_peer_failure(error):
                raise rank_lost(error, places, config.parallel.timeout_s, topology.rank) from error
            raise
        except Exception:
            if topology.rank == 0 and not start.trained:
                start.take_back()
            raise
        finally:
            lock.release()
    finally:
        if stop_signals is None:
            signals.restore()


def _train_locked(config: Config, topology: Topology, places: list[RankPlace], stop_signals: StopSignals,
                  recompute: RecomputeDecision, start: RunDirectoryStart, tokenizer_sha256: str) -> TrainState:
    # The default generator drives dropout only; TP ranks share a stream so replicated
    # activations get identical masks (CP ranks, holding other tokens, do not). Its state is checkpointed per rank.
    torch.manual_seed(config.train.seed + 1000 * topology.pipeline_parallel_rank + topology.replica_rank)
    clear_stale_build_locks()  # before DeepSpeed loads (and maybe JIT-builds) its ops
    candidates = resume_candidates(config)
    resume_rules(config, candidates, tokenizer_sha256)  # `check` runs the same: refusals before any model is built
    with stop_signals.held():  # DeepSpeed runs ninja while it loads its ops (StopSignals.held)
        model = build_training_model(config, topology)
        if config.train.init_from and not candidates:
            weights = load_init_weights(config.train.init_from)
            load_full_state_dict(model, weights, topology.tensor_parallel_rank, topology.tensor_parallel_size)
        engine = build_engine(model, config, topology)
    run_dir = Path(config.run.dir)
    state, resumption = _restore_or_start(engine, config, topology, run_dir, candidates, tokenizer_sha256)
    start.state = state
    guard = NonFiniteGuard(engine, topology.device, LossSpikes.for_run(config.train.spike, state))
    facts = {**_scaling_facts(config, topology), "hosts": hosts_of(places)}
    if topology.is_logging_rank:
        print(_start_line(config, topology, facts, state, resumption, recompute), file=sys.stderr, flush=True)
        if topology.world_size > 1:
            print("\n".join(place_lines(places, topology)), file=sys.stderr, flush=True)
    logger = MetricsLogger.for_run(config, run_dir, topology.is_logging_rank, facts, resumed_step=state.step)
    try:
        _run(engine, guard, config, topology, state, logger, stop_signals,
             checkpoint_provenance(config, tokenizer_sha256))
    finally:
        logger.close()
    return state


def _check_checkpoints_writable(run_dir: Path, topology: Topology) -> None:
    """Every rank writes its share of each checkpoint, so each checks that it can; all stop on the
    first failure, which rank 0 names even when only another rank met it."""
    error = None
    try:
        check_checkpoints_writable(run_dir)
    except CheckpointError as failure:
        error = failure
    reason = _first_failure(error, topology)
    if reason is not None:
        raise CheckpointError(reason)


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
    stop_signals: StopSignals, provenance: dict[str, str],
) -> None:
    """Steps until train.steps or an agreed early stop; every side concern is a hook (train/hooks/).
    `provenance` goes into each checkpoint's meta.json (resume_policy.checkpoint_provenance)."""
    global_batch = topology.layout.global_batch
    objective = build_objective(config)

    def batches_from(consumed_samples: int) -> Iterator[dict[str, torch.Tensor]]:
        loader = objective.train_loader(topology.data_parallel_rank, topology.data_parallel_size, consumed_samples)
        return _device_batches(loader, topology.device, stop_signals)

    batches = TimedBatches(batches_from(state.consumed_samples))
    hooks = build_hooks(engine, objective, config, topology, logger, batches, provenance)
    stop = StopConditions(config.train, stop_signals)
    try:
        hooks.on_train_start(state)
        while state.step < config.train.steps:
            hooks.on_step_start(state)
            guard.start_step(inject_nonfinite_loss=_injects_nonfinite_loss(config, topology, state.step + 1),
                             inject_spike=_injected_spike(config, topology, state.consumed_samples // global_batch + 1))
            # The LR is a function of the step and the config as written now, so a resume with a
            # changed train.lr, min_lr, steps or warmup follows the new schedule from this step.
            try:
                record = train_step(
                    engine, guard, batches, config.train.grad_accum, learning_rate(state.step, config.train))
            except StoppedWaitingForData as stalled:
                _give_up_the_step(stalled, state, hooks, topology)
                break
            state.count_step(global_batch, guard.skipped, guard.spiked)
            record.update(step=state.step, skipped_steps=state.skipped_steps)
            if guard.spikes is not None:
                guard.spikes.record(record, guard.skipped)
                record["spike_steps"] = state.spike_steps
            try:
                hooks.on_step_end(state, record)
            except Rewind as rewind:
                _rewind(engine, config, topology, state, rewind, logger)
                batches.replace(batches_from(state.consumed_samples))
                hooks.on_rewind(state)
                continue
            finished = state.step == config.train.steps
            state.stopped_by = None if finished else stop.poll(state.steps_this_run, topology.device,
                                                               pending_save_failed())
            if state.stopped_by == SAVE_FAILED:
                finish_pending_save()  # raises, on every rank, the failure the write agreed on
            hooks.after_stop_check(state)
            if state.stopped_by:
                break
        finish_pending_save()  # the last checkpoint is published before the run reports it
    except BaseException:
        abandon_pending_save()  # a lost rank may never agree on it; the next start removes its files
        raise
    finally:
        hooks.close()
    hooks.on_train_end(state)


def _rewind(engine: Any, config: Config, topology: Topology, state: TrainState, rewind: Rewind,
            logger: MetricsLogger) -> None:
    """Back to the last checkpoint before a run of spikes (train.spike.rewind), skipping the next
    train.spike.rewind_skip_batches batches of data (PaLM, Chowdhery et al. 2022, sec. 5.1: restart about
    100 steps before the spike and skip 200-500 batches). The checkpoints from the update before the first
    spike on are set aside as a divergence's are. A function of the run's own history, so a rerun
    rewinds at the same steps to the same checkpoint and skips the same samples."""
    spike, run_dir = config.train.spike, Path(config.run.dir)
    set_aside = set_aside_blown_up(config, topology, blown_up_at=rewind.first_spike - 1)
    dist.barrier()  # rank 0 moved the blown-up checkpoints aside
    good = [path for path in complete_checkpoints(run_dir)
            if int(path.name.removeprefix("step_")) < rewind.first_spike - 1]
    if not good:
        raise TrainingDiverged(f"training diverged: the loss spiked at steps {rewind.first_spike}-{rewind.last_spike} "
                               f"and no checkpoint before them is left to rewind to (train.spike.rewind). {set_aside}")
    meta = _load_any_layout(engine, good[-1], config, topology)
    skipped = spike.rewind_skip_batches * topology.layout.global_batch
    earlier = TrainState(step=meta.step, consumed_samples=meta.consumed_samples, resumed_from=str(good[-1]),
                         skipped_steps=meta.skipped_steps, consecutive_skipped_steps=meta.consecutive_skipped_steps,
                         hook_states=meta.hooks)
    earlier.restore_spikes(meta.spikes)
    data_window = (meta.consumed_samples, meta.consumed_samples + skipped)
    state.rewind_to(earlier, skipped)
    # logged at the step it happened; the steps trained again after it log again (a later record of a step
    # replaces an earlier one for metrics.jsonl's readers; W&B keeps the first of a step)
    logger.log({"step": rewind.last_spike, "rewind": state.rewinds, "rewound_to_step": state.step,
                "skipped_samples_from": data_window[0], "skipped_samples_to": data_window[1]})
    if topology.is_logging_rank:
        print(f"warning: the loss spiked at steps {rewind.first_spike}-{rewind.last_spike} "
              f"(train.spike.patience={spike.patience}): rewound to {good[-1]} (step {state.step}), skipping samples "
              f"{data_window[0]}-{data_window[1] - 1} ({spike.rewind_skip_batches} batches); rewind {state.rewinds} of "
              f"at most {spike.max_rewinds}", file=sys.stderr, flush=True)


def _give_up_the_step(stop: StoppedWaitingForData, state: TrainState, hooks: Hooks, topology: Topology) -> None:
    """A stop signal ended a stalled wait for data (StopSignals.waiting_for_data); the step in progress is
    given up before its update. One rank checkpoints its last complete step, as at any early stop (if
    this invocation trained one). Ranks of a larger world cannot agree on a checkpoint while others may
    be inside the step's collectives, so the rank leaves with the reason (the CLI exits 75) and the run
    resumes from its last checkpoint."""
    if topology.world_size > 1:
        raise stop
    state.stopped_by = stop.reason
    if state.steps_this_run:
        hooks.after_stop_check(state)


def _injected_spike(config: Config, topology: Topology, batch: int) -> float:
    """Fault injection for tests and drills (train.spike.inject_at): one data-parallel rank's micro-batch
    losses on these global batches of the data order are multiplied by train.spike.inject_factor, a bad
    batch every rank must skip (and a rewind's skipped data leaves behind)."""
    spike = config.train.spike
    return spike.inject_factor if batch in spike.inject_at and topology.data_parallel_rank == 0 else 1.0


def _injects_nonfinite_loss(config: Config, topology: Topology, step: int) -> bool:
    """Fault injection for tests and drills (train.inject_nonfinite_loss_at): one data-parallel rank's
    loss is made non-finite at these steps, which every rank must then skip together."""
    return step in config.train.inject_nonfinite_loss_at and topology.data_parallel_rank == 0


def _restore_or_start(
    engine: Any, config: Config, topology: Topology, run_dir: Path, candidates: list[Path], tokenizer_sha256: str
) -> tuple[TrainState, Resumption | None]:
    """Resume from the first of `candidates` (resume_policy.resume_candidates) that loads, naming any that
    did not and setting aside those of this run (divergence.set_aside_rejected), or start at step 0.
    Every rank takes the same checkpoint: a failure on any rank skips it on all. Each is held to the
    resume rules (resume_policy.resumption_from) before it loads: a checkpoint of another config stops
    the run instead of quietly falling back to an older one, since the config changed, not the checkpoint."""
    if topology.rank == 0:
        for leftover in clean_leftovers(run_dir):
            print(f"removed {leftover}: left by a save or prune that was killed", file=sys.stderr)
    for index, path in enumerate(candidates):
        error = None
        try:
            resumption = resumption_from(config, path, read_meta(path), tokenizer_sha256)
            meta = _load_any_layout(engine, path, config, topology)
        except CheckpointError as failure:
            error = failure
        reason = _first_failure(error, topology)
        if reason is None:
            if path.parent != checkpoint_root(run_dir) and topology.is_logging_rank:
                _write_run_config(config, run_dir)  # a branch, or a run from another's checkpoint, starts its directory
            if topology.rank == 0:
                _set_aside_rejected(run_dir, candidates[:index])
            state = TrainState(step=meta.step, consumed_samples=meta.consumed_samples, resumed_from=str(path),
                               skipped_steps=meta.skipped_steps,
                               consecutive_skipped_steps=meta.consecutive_skipped_steps, hook_states=meta.hooks)
            state.restore_spikes(meta.spikes)
            return state, resumption
        if index + 1 == len(candidates):
            raise CheckpointError(
                f"no checkpoint of {run_dir} could be loaded; the last tried: {reason}. Delete the broken "
                "checkpoints, or start a new run (a new run.dir)"
            )
        if topology.is_logging_rank:
            print(f"warning: skipping checkpoint {path}: {reason}; trying {candidates[index + 1]}", file=sys.stderr)
    if topology.is_logging_rank:
        _write_run_config(config, run_dir)
    return TrainState(), None


def _set_aside_rejected(run_dir: Path, rejected: list[Path]) -> None:
    own = [path for path in rejected if path.parent == checkpoint_root(run_dir)]
    for moved in set_aside_rejected(run_dir, own):
        print(f"warning: moved {moved.name} to {moved.parent}: it could not be loaded (the reason is above); "
              "kept for a look, never resumed from or counted by checkpoint.keep_last", file=sys.stderr)


def _first_failure(error: CheckpointError | None, topology: Topology) -> str | None:
    """The lowest failing rank's reason on every rank (None when every rank loaded), so the warning
    says why even when only a rank that does not log failed (a file only it reads)."""
    reasons: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(reasons, str(error) if error else None)
    return next((f"{reason} (rank {rank})" if topology.world_size > 1 else reason
                 for rank, reason in enumerate(reasons) if reason), None)


def _write_run_config(config: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")


def _load_any_layout(engine: Any, path: Path, config: Config, topology: Topology) -> CheckpointMeta:
    """Any layout's checkpoint, cut for this run's (checkpoint/layout_free.py)."""
    meta = read_meta(path)
    check_files(path, meta)
    load_checkpoint(engine, path, meta, config, topology)
    return meta


def _device_batches(loader: Any, device: torch.device, stop_signals: StopSignals
                    ) -> Iterator[dict[str, torch.Tensor]]:
    batches = iter(loader)
    while True:
        with stop_signals.waiting_for_data():
            batch = next(batches, None)
        if batch is None:
            return
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _scaling_facts(config: Config, topology: Topology) -> dict[str, float]:
    """N, D and C of the whole run (Kaplan et al. 2020 notation) and the layout's derived sizes,
    for the tracker's run config."""
    counts = model_counts(config)
    global_batch = topology.layout.global_batch
    tokens = config.train.steps * global_batch * config.model.seq_length
    return {"params": counts.total_params, "non_embedding_params": counts.non_embedding_params,
            "active_params": counts.active_params,
            "flops_per_token": counts.flops_per_token, "tokens": tokens, "flops": tokens * counts.flops_per_token,
            "world_size": topology.world_size, "data_parallel_size": topology.data_parallel_size,
            "global_batch_size": global_batch, "tokens_per_step": global_batch * config.model.seq_length}


def _start_line(config: Config, topology: Topology, facts: dict[str, Any], state: TrainState,
                resumption: Resumption | None, recompute: RecomputeDecision) -> str:
    """The run in one line; a resume says what changed since its checkpoint, with the LR before and now."""
    resumed = (f"resuming at step {state.step} from {state.resumed_from}; {describe_resume(resumption, config.train)}"
               if resumption else "starting at step 0")
    active = f", {facts['active_params']:,} active" if facts["active_params"] != facts["params"] else ""
    return (f"train: {config.model.family}, {facts['params']:,} parameters ({facts['non_embedding_params']:,} "
            f"non-embedding{active}); world {topology.world_size} = TP {topology.tensor_parallel_size} x "
            + (f"CP {topology.context_parallel_size} x " if topology.context_parallel_size > 1 else "")
            + f"DP {topology.data_parallel_size} x PP {topology.pipeline_parallel_size}, "
            + (f"experts over EP {topology.expert_parallel_size} of the DP ranks, "
               if topology.expert_parallel_size > 1 else "")
            + f"ZeRO-{config.parallel.zero_stage}, {resolve_precision(config, topology.device)} "
            f"on {topology.device.type}, {recompute.describe()}{', compiled blocks' if config.train.compile else ''}; "
            f"global batch {facts['global_batch_size']} x {config.model.seq_length} = {facts['tokens_per_step']:,} "
            f"tokens per step, {config.train.steps} steps; {resumed}; run dir {config.run.dir}")
