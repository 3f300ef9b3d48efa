"""Downstream evaluation in the loop (eval.tasks): lm-evaluation-harness tasks on the training model in place, at
step 0 of a fresh run, every eval.every steps and at the last step, as PeriodicEvaluation evaluates validation.

The model is scored as it trains, with nothing loaded or copied: in eval mode and without gradients, then back in
training mode (scoring.py), lm-eval's reseeding of random, numpy and torch undone (harness.run_tasks), so a run
trains the same steps with or without it. The data-parallel replicas share the documents (lm-eval's rank and world
size are the data-parallel ones) and the ranks of one replica score theirs together, in the layout they train in
(scoring.py): the tensor-parallel ranks gather the vocabulary shards, the context-parallel ranks each score the
positions they hold, a pipeline's stages pass each batch on and the last sends the scores back; rank 0 gathers
and logs. Under ZeRO-3 (each layer's weights gathered from the data-parallel ranks at its forward) and expert
parallelism (tokens exchanged with the ranks that hold the experts) every forward is a collective of the
data-parallel ranks, so they do not share the documents: each scores all of them, every rank the same forwards in
the same order, and rank 0 logs its numbers. Generation (one new token per forward behind a KV cache) runs on a
whole model or its TP shard only: under sequence or context parallelism and pipeline stages a generate_until task
is refused, in one line, when the tasks are found. The numbers are those of `scaletrain eval RUN --tasks ...
--checkpoint STEP` on the checkpoint of the same step (evaluation/downstream.py), the same Scorer and ScaletrainLM
over the same weights, in the precision the model trains in (fp32 on CPU; a bf16 run's in-loop scores are its
bf16 weights').

metrics.jsonl gets one record per evaluation: eval/downstream/<task>/<metric> (lm-eval's metric name, with
`/<filter>` after it for a filter other than `none`) and eval/downstream/time_s, the evaluation's wall time on
rank 0, which no step's step_time_s includes; W&B and TensorBoard get the same names. lm-eval's own results JSON
goes to RUN/eval/step_NNNNNNNN/, where `scaletrain eval --tasks` writes that checkpoint's. The same metrics extend
the step's record, where RunSummary (listed after this hook) takes the last step's into summary.json.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any

from megatron.core import parallel_state

from scaletrain.config import Config, ConfigError
from scaletrain.data.storage import dataset_location
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.evaluation.downstream import EVAL_DIR, LMEvalMissing, harness_module, is_metric, write_results
from scaletrain.evaluation.scoring import Scorer
from scaletrain.families import get_family
from scaletrain.parallel.groups import Topology
from scaletrain.tracking.metrics import MetricsLogger
from scaletrain.train.hooks import Hook, TrainingRun
from scaletrain.train.hooks.console import ProgressBar
from scaletrain.train.state import TrainState

PREFIX = "eval/downstream/"
TIME_KEY = PREFIX + "time_s"


class DownstreamTasks(Hook):
    """Built only when eval.tasks lists tasks (`for_run`); the tasks are found, and lm-eval imported, before the
    first step, so a missing extra, an unknown task or a generate_until task in a layout that cannot generate
    stops the run in one line before it trains."""

    order = 90  # after validation: the record's metrics reach RunSummary

    @classmethod
    def from_run(cls, run: TrainingRun) -> DownstreamTasks | None:
        return cls.for_run(run.engine.module, run.config, run.topology, run.logger, run.hook(ProgressBar))

    def __init__(self, model: Any, config: Config, topology: Topology, logger: MetricsLogger,
                 progress: ProgressBar) -> None:
        self._config, self._topology, self._logger, self._progress = config, topology, logger, progress
        self._harness = harness_for_training(config)
        self._selection = selected_tasks(self._harness, config)
        refuse_generation_where_it_cannot_run(self._harness, self._selection, config)
        tokenizer = Tokenizer.load(dataset_location(config.data).tokenizer_path())
        scorer = Scorer(model, config, tokenizer, topology.device, config.eval.batch_size)
        info = {"scaletrain": {"run": config.run.dir, "in_loop": True, "family": config.model.family,
                               "tensor_parallel": topology.tensor_parallel_size,
                               "pipeline_parallel": topology.pipeline_parallel_size,
                               "context_parallel": topology.context_parallel_size,
                               "data_parallel": topology.data_parallel_size}}
        sharing = None if lockstep(config) else parallel_state.get_data_parallel_group()
        self._lm = self._harness.ScaletrainLM(scorer, sharing, info)

    @classmethod
    def for_run(cls, model: Any, config: Config, topology: Topology, logger: MetricsLogger,
                progress: ProgressBar) -> DownstreamTasks | None:
        return cls(model, config, topology, logger, progress) if config.eval.tasks else None

    def on_train_start(self, state: TrainState) -> None:
        if state.step == 0 and self._config.eval.every:
            self._evaluate(0)

    def on_step_end(self, state: TrainState, record: dict[str, float]) -> None:
        """The metrics extend `record` after StepMetrics logged it (metrics.jsonl has them in their own record), for
        the hooks listed after this one: RunSummary writes the last step's to summary.json."""
        every, finished = self._config.eval.every, state.step == self._config.train.steps
        if finished or (every and state.step % every == 0):
            record.update(self._evaluate(state.step))

    def _evaluate(self, step: int) -> dict[str, float]:
        """Every rank scores its share; rank 0 logs the metrics (an empty dict elsewhere) and writes the JSON."""
        evaluation = self._config.eval
        self._lm.model_info["scaletrain"]["step"] = step
        started = time.perf_counter()
        results = self._harness.run_tasks(self._lm, self._selection, lm_eval_limit(evaluation.limit),
                                          evaluation.num_fewshot, bootstrap_iters=0)
        elapsed = time.perf_counter() - started
        if not self._topology.is_logging_rank or results is None:
            return {}
        metrics = {**downstream_metrics(results), TIME_KEY: elapsed}
        self._logger.log({"step": step, **metrics})
        write_results(results, Path(self._config.run.dir) / EVAL_DIR / f"step_{step:08d}")
        self._progress.write(f"step {step}: downstream {metrics_text(metrics)}")
        return metrics


def lockstep(config: Config) -> bool:
    """Whether every forward is a collective of the data-parallel ranks (ZeRO-3 gathers the weights, expert
    parallelism exchanges the tokens): then each rank scores every request, in the same order."""
    return config.parallel.zero_stage == 3 or config.parallel.expert > 1


def harness_for_training(config: Config) -> ModuleType:
    """evaluation/harness.py (lm-eval imported), or one line: the extra is missing, or the family cannot score."""
    family = get_family(config.model.family)
    if family.generation is None:
        raise ConfigError(f"eval.tasks: a {family.name} model cannot be evaluated on lm-evaluation-harness tasks, "
                          f"which score or generate text left to right, and {family.not_generating_reason}; leave "
                          "eval.tasks empty")
    try:
        return harness_module()
    except LMEvalMissing:
        raise ConfigError(f"eval.tasks={config.eval.tasks} needs lm-evaluation-harness, which is not installed: "
                          "pip install 'scaletrain[eval]' (or leave eval.tasks empty)") from None


def selected_tasks(harness: ModuleType, config: Config) -> Any:
    """The tasks of eval.tasks, found (names among eval.include_path's tasks or lm-eval's), or one line."""
    try:
        return harness.select_tasks(config.eval.tasks, [Path(path) for path in config.eval.include_path])
    except ValueError as error:
        message = str(error).replace("--include-path DIR", "eval.include_path").removeprefix("--tasks")
        raise ConfigError(f"eval.tasks{message}") from None


def refuse_generation_where_it_cannot_run(harness: ModuleType, selection: Any, config: Config) -> None:
    """One line naming the generate_until tasks of a run whose layout cannot generate: generation decodes one new
    token per forward behind a KV cache, on a whole model or its tensor-parallel shard (scoring runs in every
    layout, scoring.py). The tasks are built to read their output types only in those layouts."""
    reason = generation_blocker(config)
    if reason is None:
        return
    generating = sorted(task for task, kind in harness.output_types(selection).items() if kind == "generate_until")
    if generating:
        names = ", ".join(generating)
        setting, why = reason
        raise ConfigError(f"eval.tasks: {names} (output_type generate_until) cannot run under {setting}: "
                          f"generation decodes one token per forward behind a KV cache, and {why}; leave {names} "
                          f"out of eval.tasks and score the run's checkpoints with `scaletrain eval RUN --tasks "
                          f"{names}`, which generates in a layout without it")


def generation_blocker(config: Config) -> tuple[str, str] | None:
    """(the setting, why it stops generation) for a layout that cannot generate; None where it can."""
    parallel = config.parallel
    if parallel.sequence_parallel:
        return "parallel.sequence_parallel", ("sequence parallelism splits every forward's sequence over the "
                                              "tensor-parallel ranks")
    if parallel.context > 1:
        return f"parallel.context={parallel.context}", ("context parallelism splits every forward's sequence over "
                                                         "the context-parallel ranks")
    if parallel.pipeline > 1:
        return f"parallel.pipeline={parallel.pipeline}", "the model's layers are split over pipeline stages"
    return None


def lm_eval_limit(limit: float | None) -> float | int | None:
    """eval.limit as `scaletrain eval --limit` hands it to lm-eval: a whole number of documents as an int."""
    if limit is None:
        return None
    return int(limit) if limit >= 1 and limit == int(limit) else limit


def downstream_metrics(results: dict) -> dict[str, float]:
    """eval/downstream/<task>/<metric>[/<filter>] of every task (and group) in lm-eval's results, numbers only."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if not is_metric(key) or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name, _, filter_name = key.partition(",")
            metrics[f"{PREFIX}{task}/{name}" + ("" if filter_name == "none" else f"/{filter_name}")] = float(value)
    return metrics


def metrics_text(metrics: dict[str, float]) -> str:
    shown = [f"{key.removeprefix(PREFIX)} {value:.4f}" for key, value in metrics.items() if key != TIME_KEY]
    return f"{', '.join(shown)} ({metrics[TIME_KEY]:.1f} s)"
