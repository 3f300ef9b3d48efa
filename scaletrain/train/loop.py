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
from tqdm import tqdm

from scaletrain.checkpoint.consolidate import load_full_state_dict
from scaletrain.checkpoint.manager import load_checkpoint, resolve_resume, save_checkpoint
from scaletrain.config import Config, ConfigError, resolve_for_world, save_config
from scaletrain.data.manifest import load_manifest
from scaletrain.parallel.groups import Topology, init_distributed, world_size_from_environment
from scaletrain.scaling.counts import model_counts
from scaletrain.tracking.flops import device_peak_flops
from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.engine import build_engine, build_training_model
from scaletrain.train.objective import Objective, build_objective
from scaletrain.train.step import evaluation_metrics, train_step

RUN_SUMMARY_FILE = "summary.json"


@dataclass
class TrainState:
    """Everything that says where a run is; with the engine's state it makes resume exact."""

    step: int = 0
    consumed_samples: int = 0


def train(config: Config) -> TrainState:
    config = resolve_for_world(config, world_size_from_environment())
    topology = init_distributed(config)
    _check_data_matches(config)
    # The default generator drives dropout only; TP ranks share a stream so replicated
    # activations get identical masks. Its state is checkpointed per rank.
    torch.manual_seed(config.train.seed + 1000 * topology.pipeline_parallel_rank + topology.data_parallel_rank)
    model = build_training_model(config, topology)
    if config.train.init_from and resolve_resume(config) is None:
        weights = torch.load(config.train.init_from, map_location="cpu", weights_only=True)
        load_full_state_dict(model, weights, topology.tensor_parallel_rank, topology.tensor_parallel_size)
    engine = build_engine(model, config, topology)
    run_dir = Path(config.run.dir)
    state = _restore_or_start(engine, config, topology, run_dir)
    logger = MetricsLogger.for_run(config, run_dir, topology.is_logging_rank, _scaling_facts(config, topology))
    try:
        _run(engine, config, topology, state, logger)
    finally:
        logger.close()
    return state


def _run(engine: Any, config: Config, topology: Topology, state: TrainState, logger: MetricsLogger) -> None:
    global_batch = config.global_batch_size(topology.data_parallel_size)
    tokens_per_step = global_batch * config.model.seq_length
    flops_per_step = model_counts(config).flops_per_token * tokens_per_step
    peak_flops = _cluster_peak_flops(config, topology)
    objective = build_objective(config)
    batches = _device_batches(
        objective.train_loader(topology.data_parallel_rank, topology.data_parallel_size, state.consumed_samples),
        topology.device,
    )
    if state.step == 0 and config.train.eval_every:
        logger.log({"step": 0, **evaluate(engine, objective, topology)})
    progress = tqdm(
        total=config.train.steps, initial=state.step, disable=not topology.is_logging_rank,
        desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 30.0,  # few lines in CI and SLURM logs
    )
    steps_this_run = 0
    final_metrics: dict[str, float] = {}
    while state.step < config.train.steps:
        started = time.perf_counter()
        record = train_step(engine, batches, config.train.grad_accum)
        elapsed = time.perf_counter() - started
        state.step += 1
        state.consumed_samples += global_batch
        steps_this_run += 1
        record.update(step=state.step, tokens=state.step * tokens_per_step, step_time_s=elapsed,
                      tokens_per_s=tokens_per_step / elapsed)
        if peak_flops:
            record["mfu"] = flops_per_step / elapsed / peak_flops
        if state.step % config.train.log_every == 0:
            logger.log(record)
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
        exiting = config.train.exit_after is not None and steps_this_run >= config.train.exit_after
        if state.step % config.checkpoint.every == 0 or exiting or finished:
            save_checkpoint(engine, config, topology, state.step, state.consumed_samples)
        if finished and topology.is_logging_rank:
            write_run_summary(Path(config.run.dir), state, tokens_per_step, flops_per_step, final_metrics)
        if exiting:
            break
    progress.close()


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
    """Validation metrics over a fixed prefix of the validation split, identical for every layout."""
    config = objective.config
    per_step = config.train.micro_batch_size * topology.data_parallel_size
    available = objective.num_eval_samples()
    num_samples = min(config.train.eval_samples, available) // per_step * per_step
    if num_samples == 0:
        raise ConfigError(
            f"the validation split of {config.data.dir} holds {available} sequences of {config.model.seq_length} "
            f"tokens, fewer than one evaluation step (micro_batch_size x data-parallel size = {per_step}); "
            "raise data.val_fraction and re-prepare, or set train.eval_every=0"
        )
    loader = objective.eval_loader(topology.data_parallel_rank, topology.data_parallel_size, num_samples)
    return evaluation_metrics(engine, list(_device_batches(loader, topology.device)))


def _restore_or_start(engine: Any, config: Config, topology: Topology, run_dir: Path) -> TrainState:
    resume_from = resolve_resume(config)
    if resume_from is None:
        if topology.is_logging_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, run_dir / "config.yaml")
        return TrainState()
    meta = load_checkpoint(engine, resume_from, config, topology)
    if topology.is_logging_rank:
        print(f"resumed from {resume_from} at step {meta.step}", file=sys.stderr)
    return TrainState(step=meta.step, consumed_samples=meta.consumed_samples)


def _check_data_matches(config: Config) -> None:
    manifest = load_manifest(Path(config.data.dir))
    if manifest.vocab_size != config.data.vocab_size:
        raise ConfigError(
            f"data.vocab_size={config.data.vocab_size} but {config.data.dir} was prepared with "
            f"vocab_size={manifest.vocab_size}; set data.vocab_size={manifest.vocab_size} or re-run prepare"
        )


def _device_batches(loader: Any, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for batch in loader:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _scaling_facts(config: Config, topology: Topology) -> dict[str, float]:
    """N, D and C of the whole run (Kaplan et al. 2020 notation), for the tracker's run config."""
    counts = model_counts(config)
    tokens = config.train.steps * config.global_batch_size(topology.data_parallel_size) * config.model.seq_length
    return {"params": counts.total_params, "non_embedding_params": counts.non_embedding_params,
            "flops_per_token": counts.flops_per_token, "tokens": tokens, "flops": tokens * counts.flops_per_token}


def _cluster_peak_flops(config: Config, topology: Topology) -> float | None:
    name = torch.cuda.get_device_name() if topology.device.type == "cuda" else "cpu"
    peak = device_peak_flops(name, config.tracking.peak_tflops)
    return peak * topology.world_size if peak else None

