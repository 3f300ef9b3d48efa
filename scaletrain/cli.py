"""Command line: `scaletrain prepare|train|check|config|plan|sweep|fit|generate|eval|eval-tasks|export|import`
(or `python -m scaletrain`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain import __version__
from scaletrain.config import Config, ConfigError, ConfigWarning, config_yaml, derived_comment
from scaletrain.config_loader import load_config
from scaletrain.disk import DiskWriteError
from scaletrain.families import FAMILIES, MODEL_SECTIONS
from scaletrain.notices import quiet_cpu_notices, quiet_library_notices
from scaletrain.planner.command import add_plan_arguments, plan_from_args
from scaletrain.scaling.fit_arguments import add_fit_arguments
from scaletrain.scaling.sweep.commands import add_sweep_arguments, sweep_from_args

if TYPE_CHECKING:
    from scaletrain.data.manifest import Manifest

EXIT_USER_ERROR = 2  # argparse's code for a usage error; ours for any error the user's input caused
USER_ERROR = "user_error"  # the errorTraits category of a rank's error file (_leave_for_launcher)


def main(argv: list[str] | None = None) -> int:
    """Each command imports what it uses when it runs: `--help`, `--version` and the parser need
    no torch, DeepSpeed or megatron (tests/test_cli.py checks)."""
    quiet_library_notices(_is_reporting_rank())
    warnings.formatwarning = _format_warning
    parser = _build_parser()
    args = _parse_arguments(parser, argv)
    try:
        exit_code = args.handler(args)
    except (ConfigError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError, DiskWriteError) as error:
        # User-facing errors (config, data, checkpoint) are ValueErrors with a message that
        # names the culprit and the fix, and file errors name the path and the cause; show
        # that, not a traceback.
        line = f"scaletrain {args.command}: error: {error}"
        if _is_reporting_rank():
            print(line, file=sys.stderr)
        _leave_for_launcher(line)
        if not _is_reporting_rank():
            _give_the_reporting_rank_time()
        return EXIT_USER_ERROR
    return exit_code or 0


# How long another rank waits, after a user error, for rank 0 to report the same one (see below).
REPORTING_GRACE_S = 10.0


def _give_the_reporting_rank_time() -> None:
    """Under torchrun every rank meets the same user error but rank 0 alone prints it, and torchrun
    ends the other ranks with SIGTERM as soon as one has exited: a rank that got there first would
    have rank 0 killed before it printed (seen on a loaded box). So the others wait, with SIGTERM's
    default action back, until torchrun ends them once rank 0 has exited (or the grace has passed).
    Under srun (no TORCHELASTIC_RUN_ID) every task runs to its own end, so no rank waits."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(REPORTING_GRACE_S)


_PYTHON_FORMAT_WARNING = warnings.formatwarning


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """A ConfigWarning as one `warning: ...` line, like scaletrain's other warnings; others as Python
    writes them (file, line and source of the call)."""
    if issubclass(category, ConfigWarning):
        return f"warning: {message}\n"
    return _PYTHON_FORMAT_WARNING(message, category, filename, lineno, line)


def _parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Dotted overrides may come before or after options (`train CONFIG a.b=1 --x c.d=2`).

    argparse stops filling a `nargs="*"` positional at the first option, and its intermixed parser
    does not support subcommands, so the overrides it leaves over are appended here, in order.
    """
    args, leftovers = parser.parse_known_args(argv)
    if leftovers and hasattr(args, "overrides"):
        unknown = [item for item in leftovers if item.startswith("-") or "=" not in item]
        if not unknown:
            args.overrides = [*args.overrides, *leftovers]
            return args
        leftovers = unknown
    if leftovers:
        parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
    return args


def _is_reporting_rank() -> bool:
    """Under torchrun or srun every rank meets the same config or data error: rank 0 alone prints
    it, so the user reads it once. Errors that one rank alone meets (a checkpoint file that fails to
    load) are agreed across ranks before they are raised, so rank 0 names them too."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _leave_for_launcher(line: str) -> None:
    """Under torchrun, the error line in this rank's error file, where scaletrain-torchrun finds it
    when rank 0 could not print it (the agent stopped rank 0 first, or rank 0 runs on another node).

    torchrun's agent names the file in TORCHELASTIC_ERROR_FILE; the record has the form torch's own
    `record` writes (torch/distributed/elastic/multiprocessing/errors/error_handler.py), with
    torch's errorTraits marking it a user error, so plain torchrun shows the line in its report
    instead of a link to its docs."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}},
                  "errorTraits": {"category": USER_ERROR, "retryability": "False"}}
        Path(error_file).write_text(json.dumps(record))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scaletrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="train the tokenizer and write token shards")
    prepare.add_argument("config", type=Path, help="the run's YAML config, e.g. configs/gpt_tiny.yaml")
    prepare.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.vocab_size=4096")
    prepare.add_argument("--force", action="store_true", help="rebuild even if data.dir is already prepared")
    prepare.set_defaults(handler=_prepare)

    train = commands.add_parser("train", help="train a model (run under torchrun for several ranks)")
    train.add_argument("config", type=Path, help="the run's YAML config, e.g. configs/gpt_tiny.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 parallel.tensor=2")
    train.set_defaults(handler=_train)

    check = commands.add_parser("check", help="validate a run before launching it: config, data, layout, run dir")
    check.add_argument("config", type=Path, help="the run's YAML config, as `train` will get it")
    check.add_argument("overrides", nargs="*", help="the dotted overrides `train` will get")
    check.add_argument("--world-size", type=int, default=1, help="ranks the run will start (default 1)")
    check.add_argument("--ranks-per-node", type=int,
                       help="ranks each node starts: then a TP group that would span nodes is refused too")
    check.set_defaults(handler=_check)

    config = commands.add_parser("config", help="print a config as train resolves it (every key, defaults included)")
    config.add_argument("config", type=Path, nargs="?", help="the run's YAML config, e.g. configs/gpt_tiny.yaml")
    config.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20")
    config.add_argument("--keys", action="store_true",
                        help="print instead every key a config may set, with its type, default and meaning")
    config.set_defaults(handler=_config)

    plan = commands.add_parser("plan", help="rank the parallel layouts that fit a model on N GPUs")
    add_plan_arguments(plan)
    plan.set_defaults(handler=_plan)

    sweep = commands.add_parser("sweep", help="scaling-law sweeps: plan, run (local/torchrun/SLURM), status")
    add_sweep_arguments(sweep)
    sweep.set_defaults(handler=_sweep)

    fit = commands.add_parser("fit", help="fit scaling laws (Chinchilla approaches 1-3) to a sweep or a CSV")
    add_fit_arguments(fit)
    fit.set_defaults(handler=_fit)

    export = commands.add_parser("export", help="write a run's checkpoint as a Hugging Face model")
    export.add_argument("run_dir", type=Path, help="the run directory (run.dir); its newest loadable checkpoint")
    export.add_argument("out_dir", type=Path, help="where to write the Hugging Face model (config + weights)")
    export.add_argument("--format", choices=["hf"], default="hf", help="output format: Hugging Face transformers")
    _add_checkpoint_argument(export)
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="the exported weights' type (default: fp32, the master weights' own)")
    export.set_defaults(handler=_export)

    import_ = commands.add_parser("import", help="convert a Hugging Face model into weights for train.init_from")
    import_.add_argument("hf_dir", type=Path, help="a Hugging Face model directory (config.json + weights)")
    import_.add_argument("out_file", type=Path, help="the weights file to write, for train.init_from")
    import_.add_argument("--family", required=True, choices=list(FAMILIES),
                         help="the model family to import into")
    import_.set_defaults(handler=_import)

    generate = commands.add_parser("generate", help="sample text from a run's checkpoint (the newest that loads)")
    generate.add_argument("run_dir", type=Path, help="the run directory (run.dir); its newest loadable checkpoint")
    generate.add_argument("--prompt", default="", help="text to continue (default: empty)")
    generate.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default: 100)")
    generate.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (default: 0.8)")
    generate.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: 50)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    _add_checkpoint_argument(generate)
    generate.set_defaults(handler=_generate)

    evaluate = commands.add_parser("eval", help="validation metrics of a run's checkpoint, without training; with "
                                   "--tasks, lm-evaluation-harness tasks (in one process, or under torchrun in the "
                                   "run's tensor-parallel layout and, where the world size allows, its pipeline "
                                   "stages)")
    evaluate.add_argument("run_dir", type=Path, help="the run directory (run.dir); its newest loadable checkpoint")
    _add_checkpoint_argument(evaluate)
    evaluate.add_argument("--samples", default=None,
                          help="validation sequences to read: a number (a sample drawn with the run's "
                               "train.eval_seed) or all (default: the run's train.eval_samples)")
    _add_task_arguments(evaluate)
    evaluate.set_defaults(handler=_evaluate)

    eval_tasks = commands.add_parser("eval-tasks", help="the data of the local lm-evaluation-harness tasks "
                                     "(configs/eval_tasks/)")
    eval_tasks_commands = eval_tasks.add_subparsers(dest="eval_tasks_command", required=True)
    build = eval_tasks_commands.add_parser(
        "build", help="write the local tasks' JSONL files from the held-out (val) split of a prepared dataset")
    build.add_argument("config", type=Path, help="a config whose data.dir is prepared, e.g. configs/gpt_tiny.yaml")
    build.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.dir=data/other")
    build.add_argument("--out", type=Path, required=True,
                       help="the directory the task YAMLs read, e.g. data/eval_tasks/shakespeare")
    build.add_argument("--count", type=int, default=100, help="records per task (default: 100)")
    build.add_argument("--seed", type=int, default=0, help="seeds the draw of records and choices (default: 0)")
    build.set_defaults(handler=_build_eval_tasks)
    return parser


def _add_checkpoint_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("--checkpoint", default=None,
                         help="a step (300), a checkpoint's name under RUN/checkpoints (step_00000300) or its "
                              "directory (default: the newest that loads)")


def _add_task_arguments(evaluate: argparse.ArgumentParser) -> None:
    """`eval --tasks`'s options: lm-evaluation-harness's, by the names its CLI gives them."""
    evaluate.add_argument("--tasks", default=None,
                          help="lm-evaluation-harness tasks instead of the validation loss: names (hub datasets, "
                               "where reachable), task YAML files or directories of them, comma-separated, e.g. "
                               "configs/eval_tasks/shakespeare_passages.yaml (needs pip install 'scaletrain[eval]')")
    evaluate.add_argument("--include-path", type=Path, action="append", default=[],
                          help="a directory of local task YAMLs that --tasks names refer to, e.g. configs/eval_tasks "
                               "(repeatable)")
    evaluate.add_argument("--limit", default=None, help="documents per task: a number, or a fraction below 1")
    evaluate.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="requests per forward (default: 8)")
    evaluate.add_argument("--bootstrap-iters", type=int, default=100_000,
                          help="bootstrap resamples for the stderr of perplexity metrics; 0: none (default: 100000)")
    evaluate.add_argument("--out", type=Path, default=None,
                          help="where to write lm-eval's results JSON (default: RUN/eval/step_NNNNNNNN)")
    evaluate.add_argument("--log-samples", action="store_true",
                          help="also write each document's requests and responses (samples_TASK_TIME.jsonl)")


def _prepare(args: argparse.Namespace) -> None:
    """Prepare into data.dir; a remote data.dir (s3://, gs://, file://) is prepared in a staging
    directory under the shard cache and uploaded, manifest last."""
    from scaletrain.data.storage import ShardCacheSettings, dataset_location, is_local, upload_dataset, writable_url

    config = load_config(args.config, args.overrides)
    target = config.data.dir
    if not is_local(target):
        writable_url(target)
    if dataset_location(config.data, target).is_prepared() and not args.force:
        print(f"{target} is already prepared; pass --force to rebuild it")
        return
    if is_local(target):
        manifest = _prepare_into(config, Path(target), overwrite=args.force)
    else:
        staging_root = ShardCacheSettings.from_data_config(config.data).directory / "prepare"
        staging_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=staging_root))
        try:
            manifest = _prepare_into(config, staging / "dataset", overwrite=False)
            print(f"uploading to {target}", file=sys.stderr)
            upload_dataset(staging / "dataset", target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    totals = ", ".join(f"{name}: {split.num_docs} documents, {split.num_tokens} tokens in {len(split.shards)} shards"
                       for name, split in manifest.splits.items())
    dropped = manifest.settings.get("duplicates_dropped")
    duplicates = "; deduplication off" if dropped is None else f"; {dropped} exact duplicate documents dropped"
    print(f"prepared {target} ({totals}{duplicates})")


def _prepare_into(config: Config, data_dir: Path, overwrite: bool) -> Manifest:
    from scaletrain.data.prepare import prepare_dataset

    return prepare_dataset(
        config.data.raw, data_dir, vocab_size=config.data.vocab_size, num_sentinels=config.data.num_sentinels,
        val_fraction=config.data.val_fraction, max_tokens_per_shard=config.data.max_tokens_per_shard,
        num_workers=config.data.prepare_workers, seed=config.train.seed, overwrite=overwrite, show_progress=True,
        dedup=config.data.dedup, tokenizer_file=config.data.tokenizer,
        tokenizer_train_bytes=config.data.tokenizer_train_bytes,
    )


def _train(args: argparse.Namespace) -> int:
    """Exit 0 when the run trained all its steps, EXIT_STOPPED_EARLY (75) when a signal,
    train.exit_after or train.exit_after_minutes stopped it at a checkpoint: resume by running again;
    EXIT_DIVERGED (3) when it stopped on non-finite losses or weights: change the config first;
    EXIT_RANK_LOST (76) when another rank was lost (parallel/peer_loss.py): resume by running again,
    from the last checkpoint. A rank of several that a stop signal took out of a stalled wait for data
    exits 75 without a checkpoint of the step in progress (loop._give_up_the_step says why).

    The stop handlers go in as soon as the config names them and are never taken out; once the
    exit code is known the stop signals are ignored (train/stopping.py StopSignals says why).
    A run already at train.steps says so in one line and exits 0 (resume_policy.NothingToTrain)."""
    from scaletrain.checkpoint.resume_policy import NothingToTrain
    from scaletrain.parallel.groups import destroy_distributed
    from scaletrain.parallel.peer_loss import EXIT_RANK_LOST, RankLost
    from scaletrain.train.loop import train
    from scaletrain.train.nonfinite import EXIT_DIVERGED, TrainingDiverged
    from scaletrain.train.stopping import EXIT_STOPPED_EARLY, StoppedWaitingForData, StopSignals

    quiet_cpu_notices()
    config = load_config(args.config, args.overrides)
    stop_signals = StopSignals(config.train.stop_signals)
    try:
        state = train(config, stop_signals)
    except NothingToTrain as finished:
        if _is_reporting_rank():
            print(finished, file=sys.stderr)
        return 0
    except TrainingDiverged as error:
        if _is_reporting_rank():
            print(f"scaletrain train: error: {error}", file=sys.stderr)
        return EXIT_DIVERGED
    except RankLost as error:
        if error.reports:  # every surviving rank knows; the first surviving one of each host says it
            print(f"scaletrain train: error: {error}", file=sys.stderr, flush=True)
        return EXIT_RANK_LOST
    except StoppedWaitingForData as stop:  # only the ranks whose data stalled know: each says so
        print(f"scaletrain train: stopped early ({stop.reason}) on rank {os.environ.get('RANK', '0')}; the step "
              "in progress is given up without a checkpoint, since the other ranks may be inside it; run the same "
              "command again to resume from the last checkpoint", file=sys.stderr, flush=True)
        return EXIT_STOPPED_EARLY
    finally:
        destroy_distributed()
        stop_signals.ignore_while_exiting()
    return EXIT_STOPPED_EARLY if state.stopped_by else 0


def _check(args: argparse.Namespace) -> None:
    """The summary of the run `train` would start; train's own line for what it would refuse (exit 2),
    and for a run with nothing left to train (exit 0, as train)."""
    from scaletrain.checkpoint.resume_policy import NothingToTrain
    from scaletrain.train.preflight import preflight

    try:
        print(preflight(args.config, args.overrides, args.world_size, args.ranks_per_node).summary())
    except NothingToTrain as finished:
        print(finished)


def _config(args: argparse.Namespace) -> None:
    """The YAML that load_config reads back to the same Config, or the schema (config_schema.py)."""
    from scaletrain.config_schema import schema_text

    if args.keys:
        print(schema_text(MODEL_SECTIONS), end="")
        return
    if args.config is None:
        raise ConfigError("give a YAML config (e.g. scaletrain config configs/gpt_tiny.yaml), or --keys for the schema")
    config = load_config(args.config, args.overrides)
    print(config_yaml(config) + derived_comment(config), end="")


def _plan(args: argparse.Namespace) -> None:
    print(plan_from_args(args), end="")


def _sweep(args: argparse.Namespace) -> None:
    output = sweep_from_args(args)
    if output:
        print(output, end="" if output.endswith("\n") else "\n")


def _fit(args: argparse.Namespace) -> None:
    from scaletrain.scaling.fit_source import fit_from_args

    print(fit_from_args(args), end="")


def _export(args: argparse.Namespace) -> int:
    """Exit 0, or 128 + the signal's number when Ctrl-C or SIGTERM stopped it (the shell's convention)."""
    from scaletrain.export import ExportInterrupted, export_run

    try:
        print(f"exported {export_run(args.run_dir, args.out_dir, args.checkpoint, args.dtype)}")
    except ExportInterrupted as stop:
        print(f"scaletrain export: stopped by {signal.Signals(stop.signal).name}; nothing was written at "
              f"{args.out_dir}", file=sys.stderr)
        return 128 + stop.signal
    return 0


def _import(args: argparse.Namespace) -> None:
    from scaletrain.export import import_to_file

    out = import_to_file(args.hf_dir, args.family, args.out_file)
    print(f"wrote {out}; start a run from it with train.init_from={out}")


def _generate(args: argparse.Namespace) -> None:
    from scaletrain.generate import generate_text

    print(generate_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                        args.checkpoint))


TASK_OPTIONS = {"include_path": "--include-path", "limit": "--limit", "num_fewshot": "--num-fewshot",
                "out": "--out", "log_samples": "--log-samples"}


def _evaluate(args: argparse.Namespace) -> None:
    """The validation metrics, or with --tasks lm-evaluation-harness's (evaluation/downstream.py)."""
    if args.tasks is not None:
        _evaluate_tasks(args)
        return
    given = [option for name, option in TASK_OPTIONS.items() if getattr(args, name)]
    if given:
        raise ConfigError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --tasks (lm-evaluation-"
                          "harness tasks); without it eval reports the validation loss")
    from scaletrain.evaluate import evaluate_checkpoint

    print(evaluate_checkpoint(args.run_dir, args.checkpoint, args.samples).summary())


def _evaluate_tasks(args: argparse.Namespace) -> None:
    from scaletrain.evaluation.downstream import TaskRun, evaluate_downstream, parse_limit, task_list

    if args.samples is not None:
        raise ConfigError("--samples sets the validation sequences, which --tasks does not read; --limit sets "
                          "the documents per task")
    run = TaskRun(task_list(args.tasks), tuple(args.include_path),
                  parse_limit(args.limit) if args.limit is not None else None, args.num_fewshot, args.batch_size,
                  args.bootstrap_iters, args.log_samples)
    evaluation = evaluate_downstream(args.run_dir, run, args.checkpoint, args.out)
    if evaluation is not None:
        print(evaluation.summary())


def _build_eval_tasks(args: argparse.Namespace) -> None:
    from scaletrain.evaluation.task_data import build_task_data

    config = load_config(args.config, args.overrides)
    files = build_task_data(config.data, args.out, args.seed, args.count)
    print(f"wrote {', '.join(str(path) for path in files.values())} from the held-out split of {config.data.dir}")
