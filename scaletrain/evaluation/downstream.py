"""`scaletrain eval RUN --tasks ...`: lm-evaluation-harness tasks on a checkpoint as it is (no export), in one
process or under torchrun in the tensor-parallel and pipeline layout that trained it.

Under a launcher every rank builds the model for its place in TP x PP x DP, TP and PP being the run's own, and
reads only its shards of the weights (checkpoint/layout_free.py); the data-parallel replicas share the requests.
The pipeline stages are kept when the world size is a multiple of TP x PP and no task generates (generation
decodes one token per forward behind a KV cache, on a whole model or its TP shard: evaluation/scoring.py);
otherwise a rank holds every layer of its TP shard, the ranks a pipeline would take serve as more replicas, and
stderr says so. Context parallelism is not kept (its ranks serve as replicas too). In one process the model is
whole (TP=1), as `generate` and `eval` build it.

The results are lm-eval's own JSON, written to --out (default RUN/eval/step_NNNNNNNN/) as results_<time>.json,
and one line per task on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from scaletrain.checkpoint import layout_free
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import CheckpointMeta, read_meta, translate_load_errors
from scaletrain.checkpoint.safe_load import CheckedFiles
from scaletrain.config import Config, ConfigError, ParallelConfig
from scaletrain.data.storage import dataset_location
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.evaluation.scoring import Scorer, check_scores
from scaletrain.families import build_model, get_family
from scaletrain.parallel.groups import Topology, destroy_distributed, init_distributed, world_size_from_environment
from scaletrain.parallel.layout import resolve_for_world
from scaletrain.run_config import announce_checkpoint, chosen_checkpoint, load_chosen, stored_config

LM_EVAL_MISSING = "lm-evaluation-harness is not installed: pip install 'scaletrain[eval]'"
EVAL_DIR = "eval"
DEFAULT_BATCH_SIZE = 8
DEFAULT_BOOTSTRAP_ITERS = 100_000  # lm-eval's own default: the stderr of perplexity-type metrics is bootstrapped


class LMEvalMissing(ValueError):  # noqa: N818 - the CLI's one line: what is missing and how to install it
    """lm-evaluation-harness is not installed (an optional extra)."""


@dataclass(frozen=True)
class TaskRun:
    """What to evaluate and how: lm-eval's options as `scaletrain eval --tasks` takes them."""

    tasks: tuple[str, ...]  # task names, task YAML files, directories of them
    include_paths: tuple[Path, ...] = ()
    limit: float | None = None  # documents per task (a fraction if < 1)
    num_fewshot: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS
    log_samples: bool = False  # also write each document's requests and responses, per task


@dataclass(frozen=True)
class DownstreamEvaluation:
    checkpoint: Path
    step: int
    results: dict  # lm-eval's results JSON
    results_file: Path

    def summary(self) -> str:
        """One line per task: `TASK: metric value ± stderr, ... (N documents)`, then where the JSON is."""
        lines = []
        for task, metrics in self.results["results"].items():
            shown = [_metric(metrics, key) for key in metrics if is_metric(key)]
            count = self.results.get("n-samples", {}).get(task, {}).get("effective")
            lines.append(f"{task}: {', '.join(shown)}" + (f" ({count} documents)" if count is not None else ""))
        return "\n".join([*lines, f"wrote {self.results_file}"])


def evaluate_downstream(run_dir: Path, run: TaskRun, checkpoint: str | None = None, out_dir: Path | None = None
                        ) -> DownstreamEvaluation | None:
    """lm-eval's results of `run` on `checkpoint` (a directory, its name or its step) or the run's newest that
    loads; None on every rank but the first, which writes and returns them."""
    harness = harness_module()
    chosen = chosen_checkpoint(run_dir, checkpoint) if checkpoint is not None else None
    stored = stored_config(run_dir, chosen)
    check_scores(get_family(stored.model.family), run_dir)
    selection = harness.select_tasks(run.tasks, run.include_paths)
    world_size = world_size_from_environment()
    generating = (world_size > 1 and stored.parallel.pipeline > 1
                  and "generate_until" in harness.output_types(selection).values())
    config = scoring_config(stored, world_size, generating)
    topology = init_distributed(config)
    try:
        if topology.rank == 0 and config.parallel.pipeline < stored.parallel.pipeline:
            why = ("a task generates" if generating else
                   f"the world size {world_size} is not a multiple of TP x PP = {stored.parallel.tensor} x "
                   f"{stored.parallel.pipeline}")
            print(f"the run trained in {stored.parallel.pipeline} pipeline stages; {why}, so every rank holds all "
                  f"layers of its tensor-parallel shard (TP={config.parallel.tensor})", file=sys.stderr)
        path, (meta, model) = load_chosen(run_dir, chosen, partial(_load_in_layout, config, topology))
        if topology.rank == 0:
            announce_checkpoint(path, meta.step)
        tokenizer = Tokenizer.load(dataset_location(config.data).tokenizer_path())
        scorer = Scorer(model.to(topology.device), config, tokenizer, topology.device, run.batch_size)
        info = {"scaletrain": {"checkpoint": str(path), "step": meta.step, "family": config.model.family,
                               "tensor_parallel": topology.tensor_parallel_size,
                               "pipeline_parallel": topology.pipeline_parallel_size,
                               "data_parallel": topology.data_parallel_size,
                               "hf_model_args": harness.hf_model_args("EXPORT", scorer.encoder_decoder,
                                                                      scorer.context_length, tokenizer.eos_id)}}
        lm = harness.ScaletrainLM(scorer, parallel_state.get_data_parallel_group(), info)
        results = harness.run_tasks(lm, selection, run.limit, run.num_fewshot, run.bootstrap_iters, run.log_samples)
    finally:
        destroy_distributed()
    if topology.rank != 0:
        return None
    results_file = write_results(results, out_dir or run_dir / EVAL_DIR / path.name)
    return DownstreamEvaluation(path, meta.step, results, results_file)


def scoring_config(config: Config, world_size: int, generating: bool = False) -> Config:
    """The run's model in this command's world: TP=1 in one process; under a launcher the run's own TP, and its
    pipeline stages where the world size is a multiple of TP x PP and no task generates (`generating`), the
    world's other factor data-parallel replicas (no ZeRO, no sequence or context parallelism). A decoder attends
    through SDPA: requests come in many lengths, and FlexAttention (model.attention_backend=auto on a GPU) would
    build a block mask for each; how attention is computed, not what (a resume may change it)."""
    tensor = config.parallel.tensor if world_size > 1 else 1
    if world_size % tensor:
        raise ConfigError(f"world size {world_size} is not a multiple of the run's parallel.tensor={tensor}; launch "
                          f"a multiple of {tensor} ranks (torchrun --nproc_per_node={tensor}), or one process")
    pipeline = config.parallel.pipeline
    if world_size == 1 or generating or world_size % (tensor * pipeline):
        pipeline = 1
    parallel = ParallelConfig(tensor=tensor, pipeline=pipeline, pipeline_partition=config.parallel.pipeline_partition,
                              data=None, zero_stage=0, timeout_s=config.parallel.timeout_s)
    model = config.model
    if hasattr(model, "attention_backend"):
        model = dataclasses.replace(model, attention_backend="sdpa")
    return resolve_for_world(dataclasses.replace(config, parallel=parallel, model=model), world_size)


def harness_module() -> ModuleType:
    """evaluation/harness.py, which imports lm-eval: LMEvalMissing, in one line, without it."""
    try:
        from scaletrain.evaluation import harness
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] == "lm_eval":
            raise LMEvalMissing(LM_EVAL_MISSING) from None
        raise
    return harness


def _load_in_layout(config: Config, topology: Topology, checkpoint: Path) -> tuple[CheckpointMeta, torch.nn.Module]:
    """meta.json and the model on this rank (its pipeline stage under pipeline parallelism), its weights cut for
    this rank; a rank's failure fails every rank."""
    meta = read_meta(checkpoint)
    if config.parallel.pipeline > 1:
        from scaletrain.model.pipeline import build_pipeline  # imports DeepSpeed

        model = build_pipeline(config, topology, get_family(config.model.family))
    else:
        model = build_model(config)
    failure = None
    try:
        translate_load_errors(checkpoint, layout_free.STATE_DIR, lambda: layout_free.load_weights(
            model, checkpoint, CheckedFiles(checkpoint, meta.files), topology))
    except CheckpointError as error:
        failure = str(error)
    failures: list[str | None] = [None] * topology.world_size
    dist.all_gather_object(failures, failure)
    first = next((failure for failure in failures if failure), None)
    if first:
        raise CheckpointError(first)
    return meta, model.eval()


def write_results(results: dict, out_dir: Path) -> Path:
    """lm-eval's results as its CLI writes them, named as it names them: results_<time>.json, and with
    --log-samples samples_<task>_<time>.jsonl, one document a line."""
    from lm_eval.utils import handle_non_serializable

    def dumped(record: dict, indent: int | None = None) -> str:
        return json.dumps(record, indent=indent, default=handle_non_serializable, ensure_ascii=False) + "\n"

    out_dir.mkdir(parents=True, exist_ok=True)
    time = datetime.now().strftime("%Y-%m-%dT%H-%M-%S.%f")
    for task, samples in results.pop("samples", {}).items():
        (out_dir / f"samples_{task}_{time}.jsonl").write_text("".join(map(dumped, samples)))
    path = out_dir / f"results_{time}.json"
    path.write_text(dumped(results, indent=2))
    return path


def is_metric(key: str) -> bool:
    return "," in key and "_stderr," not in key


def _metric(metrics: dict, key: str) -> str:
    name, _, filter_name = key.partition(",")
    value, stderr = metrics[key], metrics.get(f"{name}_stderr,{filter_name}")
    shown = f"{name} {value:.4f}"
    return shown + (f" ± {stderr:.4f}" if isinstance(stderr, float) else "")


def parse_limit(text: str) -> float:
    """--limit: a number of documents per task, or a fraction of them below 1 (lm-eval's `limit`)."""
    try:
        limit = float(text)
    except ValueError:
        raise ConfigError(f"--limit {text}: give a number of documents per task, or a fraction below 1") from None
    if limit <= 0:
        raise ConfigError(f"--limit {text} must be positive")
    return int(limit) if limit >= 1 and limit == int(limit) else limit


def task_list(text: str) -> tuple[str, ...]:
    """--tasks TASK[,TASK...]."""
    tasks = tuple(task.strip() for task in text.split(",") if task.strip())
    if not tasks:
        raise ConfigError("--tasks is empty; give task names, task YAML files or directories, comma-separated")
    return tasks
