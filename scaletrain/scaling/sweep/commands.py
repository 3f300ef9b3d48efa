"""`scaletrain sweep plan|run|tune|status|finalize|archive|restore|run-one`: the command line of scaling-law sweeps."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.config import ConfigError
from scaletrain.scaling.sweep.ladder import ladder_flops, ladder_lines
from scaletrain.scaling.sweep.layout import PLAN_FILE, RESULTS_FILE, RUNS_DIR, SWEEP_FILE
from scaletrain.scaling.sweep.spec import SweepSpec, load_sweep_spec, spec_from_dict
from scaletrain.tracking.durations import format_duration

if TYPE_CHECKING:
    from scaletrain.scaling.sweep.plan import SweepPlan

# The executors, planner and results import torch and the model code: loaded when a command runs,
# so `scaletrain --help` stays fast.
EXECUTORS = ("local", "torchrun", "slurm")
JOBS_HELP = ("runs trained at once on this machine (local and torchrun executors), each with its own GPUs "
             "(--nproc of them) or a share of the cores; the results do not depend on it")


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="sweep_command", required=True)
    plan = commands.add_parser("plan", help="the table of runs a sweep spec expands into, with totals")
    plan.add_argument("spec", type=Path, help="the sweep spec, e.g. configs/sweeps/isoflop_shakespeare.yaml")
    plan.set_defaults(sweep_handler=_plan)

    run = commands.add_parser("run", help="train the sweep's unfinished runs (idempotent), then fit")
    run.add_argument("spec", type=Path, help="the sweep spec, e.g. configs/sweeps/isoflop_shakespeare.yaml")
    run.add_argument("--executor", choices=EXECUTORS, default="local",
                     help="local: one process per run; torchrun: --nproc ranks per run; slurm: a job array")
    run.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun and slurm)")
    run.add_argument("--jobs", type=int, default=1, help=JOBS_HELP)
    run.set_defaults(sweep_handler=_run)

    tune = commands.add_parser("tune", help="train the spec's `tune:` LR grid (idempotent) and fit the optimal "
                               "LR's power law in N (in N and D at several horizons) into SWEEP/tune/tuned.json; "
                               "then, with tune.check, train the rule at 0.5x/1x/2x into SWEEP/tune/check.json")
    tune.add_argument("spec", type=Path, help="a sweep spec with a `tune:` section")
    tune.add_argument("--jobs", type=int, default=1, help=JOBS_HELP)
    tune.add_argument("--plan", action="store_true", help="print the grid's and the check's runs and their "
                      "predicted time; train nothing")
    tune.set_defaults(sweep_handler=_tune)

    status = commands.add_parser("status", help="pending/queued/running/done/failed per run, with progress "
                                                "(latest logged step / total) and final val_loss")
    status.add_argument("source", type=Path, help="the sweep spec or its directory")
    status.set_defaults(sweep_handler=_status)

    finalize = commands.add_parser("finalize", help="write results.csv, fit and log the W&B summary run")
    finalize.add_argument("source", type=Path, help="the sweep spec or its directory")
    finalize.set_defaults(sweep_handler=_finalize)

    archive = commands.add_parser("archive", help="copy the finished runs' records (no checkpoints) to a directory "
                                  "that outlasts this machine; `sweep restore` puts them back")
    archive.add_argument("source", type=Path, help="the sweep spec or its directory")
    archive.add_argument("archive_dir", type=Path, metavar="ARCHIVE", help="the archive directory (created, or "
                         "extended with the runs finished since)")
    archive.set_defaults(sweep_handler=_archive)

    restore = commands.add_parser("restore", help="put an archive's runs back, so `sweep run` and `sweep tune` skip "
                                  "them and the fit reads them")
    restore.add_argument("archive_dir", type=Path, metavar="ARCHIVE", help="a directory `sweep archive` wrote")
    restore.add_argument("--to", type=Path, default=None, dest="sweep_dir",
                         help="the sweep directory to restore into (default: the one the archive was made from)")
    restore.set_defaults(sweep_handler=_restore)

    run_one_parser = commands.add_parser("run-one", help="train one run directory of a sweep (SLURM array tasks)")
    run_one_parser.add_argument("run_dir", type=Path, help="a run directory the sweep planned (holds config.yaml)")
    run_one_parser.add_argument("--nproc", type=int, default=1,
                                help="ranks for the run on each node (torchrun when > 1 on one node)")
    run_one_parser.add_argument("--nodes", type=int, default=1,
                                help="nodes of the SLURM job the run spans (srun starts its ranks when > 1)")
    run_one_parser.set_defaults(sweep_handler=_run_one)


def sweep_from_args(args: argparse.Namespace) -> str | None:
    return args.sweep_handler(args)


def _plan(args: argparse.Namespace) -> str:
    from scaletrain.scaling.sweep.plan import plan_sweep

    return format_plan(plan_sweep(load_sweep_spec(args.spec), spec_path=str(args.spec), to_show=True), str(args.spec))


def _run(args: argparse.Namespace) -> str:
    if args.nproc < 1 or (args.executor == "local" and args.nproc != 1):
        raise ConfigError(f"--nproc {args.nproc}: use --nproc 1 with --executor local, or >= 1 with torchrun/slurm")
    _check_jobs(args.jobs)
    if args.executor == "slurm" and args.jobs != 1:
        raise ConfigError(f"--jobs {args.jobs}: SLURM runs the array's tasks side by side itself (the spec's "
                          "slurm.max_concurrent); --jobs is for the local and torchrun executors")
    from scaletrain.scaling.sweep.executors import run_local, submit_slurm
    from scaletrain.scaling.sweep.plan import plan_sweep

    plan = plan_sweep(load_sweep_spec(args.spec))
    for warning in plan.warnings:
        print(f"warning: {warning}")
    if args.executor == "slurm":
        return submit_slurm(plan, args.nproc, args.spec)
    outcome = run_local(plan, args.nproc, jobs=args.jobs)
    lines = [f"sweep {plan.spec.name}: trained {len(outcome.trained)} runs, skipped {len(outcome.skipped)} "
             f"already done, {len(outcome.failed)} failed" + (f" ({', '.join(outcome.failed)})" if outcome.failed
                                                             else "")]
    return finalize_sweep(plan.directory, preamble="\n".join(lines) + "\n")


def _tune(args: argparse.Namespace) -> str:
    from scaletrain.scaling.sweep.tune import tune_sweep

    _check_jobs(args.jobs)
    return _tune_plan(args.spec) if args.plan else tune_sweep(args.spec, jobs=args.jobs)


def _check_jobs(jobs: int) -> None:
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: give the number of runs to train at once, 1 or more")


def _tune_plan(spec_path: Path) -> str:
    """`sweep tune --plan`: the grid, then the check at the rule's LR (its prior before the grid is fitted)."""
    from scaletrain.scaling.sweep.hyperparams import rules_to_show
    from scaletrain.scaling.sweep.lr_check import plan_check
    from scaletrain.scaling.sweep.tune import tune_plan

    spec = load_sweep_spec(spec_path)
    grid, _ = tune_plan(spec, str(spec_path))
    text = "tuning grid:\n" + format_plan(grid, str(spec_path))
    runs = grid.runs
    if spec.tune.check is not None:
        rules, untuned = rules_to_show(spec.hyperparameters, spec.dir, str(spec_path))
        check, _, _ = plan_check(spec, rules, str(spec_path))
        check = dataclasses.replace(check, warnings=check.warnings + ([untuned] if untuned else []))
        text += (f"LR check (trained after the grid at {', '.join(f'{m:g}x' for m in spec.tune.check.multipliers)} "
                 f"the rule's LR):\n" + format_plan(check, str(spec_path)))
        runs = runs + check.runs
    return text + (f"tune total: {len(runs)} runs, predicted {format_duration(sum(r.predicted_s for r in runs))} "
                   "on this machine\n")


def _status(args: argparse.Namespace) -> str:
    from scaletrain.scaling.sweep.results import planned_rows, write_results_csv

    sweep_dir = _sweep_dir(args.source)
    rows = planned_rows(sweep_dir)
    write_results_csv(sweep_dir, rows)
    planned = json.loads((sweep_dir / PLAN_FILE).read_text())["runs"]
    return format_status(sweep_dir, rows, {row["name"]: row.get("predicted_s") for row in planned})


def _finalize(args: argparse.Namespace) -> str:
    return finalize_sweep(_sweep_dir(args.source))


def _archive(args: argparse.Namespace) -> str:
    from scaletrain.scaling.sweep.archive import archive_sweep

    if args.source.is_dir():
        sweep_dir, name = args.source, _archived_sweep_name(args.source)
    else:
        spec = load_sweep_spec(args.source)
        sweep_dir, name = Path(spec.dir), spec.name
    outcome = archive_sweep(sweep_dir, args.archive_dir, name)
    lines = [f"archived {len(outcome.archived)} finished runs of sweep {name} in {args.archive_dir} "
             f"({len(outcome.unchanged)} already there unchanged, {outcome.unfinished} not finished)"]
    lines += [f"  kept back {run}: {why}; it trains again after a restore" for run, why in outcome.kept_back.items()]
    return "\n".join(lines) + "\n"


def _archived_sweep_name(sweep_dir: Path) -> str:
    """The sweep's name from its stored spec (SWEEP/sweep.json, or its tuning grid's)."""
    from scaletrain.scaling.sweep.hyperparams import TUNE_DIR

    for planned in (sweep_dir, sweep_dir / TUNE_DIR):
        if (planned / SWEEP_FILE).is_file():
            return stored_spec(planned).name
    raise ConfigError(f"{sweep_dir} holds no planned sweep ({SWEEP_FILE} is missing, also in {TUNE_DIR}/): archive "
                      "a sweep directory that `sweep run` or `sweep tune` has started, or give its spec")


def _restore(args: argparse.Namespace) -> str:
    from scaletrain.scaling.sweep.archive import restore_sweep

    sweep_dir, restored, kept = restore_sweep(args.archive_dir, args.sweep_dir)
    return (f"restored {len(restored)} finished runs into {sweep_dir} ({len(kept)} were already finished there); "
            "`sweep run` / `sweep tune` skip them\n")


def _run_one(args: argparse.Namespace) -> None:
    from scaletrain.scaling.sweep.executors import run_one

    code = run_one(args.run_dir, args.nproc, args.nodes)
    if code:
        raise SystemExit(code)


def finalize_sweep(sweep_dir: Path, preamble: str = "") -> str:
    """results.csv, then the fit and the W&B summary run; returns preamble + what was done. A fit that
    failed entirely exits with code 1 after printing that (finalize.fail_on_fit): training results stay."""
    from scaletrain.scaling.sweep.finalize import fail_on_fit, fit_and_log
    from scaletrain.scaling.sweep.results import planned_rows, write_results_csv

    rows = planned_rows(sweep_dir)
    path = write_results_csv(sweep_dir, rows)
    finalized = fit_and_log(sweep_dir, stored_spec(sweep_dir), rows)
    return fail_on_fit(f"{preamble}wrote {path}\n{finalized.report}", finalized)


def stored_spec(sweep_dir: Path) -> SweepSpec:
    path = sweep_dir / SWEEP_FILE
    return spec_from_dict(json.loads(path.read_text())["spec"], source=str(path))


def _sweep_dir(source: Path) -> Path:
    """A sweep directory, from the spec or the directory itself; it must have been run (planned) once."""
    sweep_dir = source if source.is_dir() else plan_directory(source)
    if not (sweep_dir / PLAN_FILE).is_file():
        raise ConfigError(f"{sweep_dir} holds no sweep yet ({PLAN_FILE} is missing); start it with "
                          f"`scaletrain sweep run SPEC`")
    return sweep_dir


def plan_directory(spec_path: Path) -> Path:
    return Path(load_sweep_spec(spec_path).dir)


def format_plan(plan: SweepPlan, spec_path: str = "SPEC") -> str:
    header = (f"{'run':<34} {'params':>10} {'non-emb':>10} {'active':>10} {'tokens':>11} {'FLOPs':>9} {'steps':>7} "
              f"{'epochs':>6} {'lr':>8} {'batch':>6} {'beta2':>6} {'warmup':>6} {'wd':>8} {'time':>8}")
    lines = [f"sweep {plan.spec.name} ({plan.spec.mode}), {len(plan.runs)} runs in {plan.directory}; "
             f"{plan.tokens_per_step:,} tokens per step at the base's batch (batch: sequences per step)",
             header, "-" * len(header)]
    for run in plan.runs:
        epochs = f"{run.epochs:.2f}" if run.epochs is not None else "?"
        lines.append(
            f"{run.name:<34} {run.counts.total_params:>10,} {run.counts.non_embedding_params:>10,} "
            f"{run.counts.active_params:>10,} {run.tokens:>11,} {run.flops:>9.3g} {run.steps:>7,} {epochs:>6} "
            f"{run.lr:>8.2e} {run.batch_size:>6} {run.beta2:>6.3g} {run.warmup_steps:>6} {run.weight_decay:>8.3g} "
            f"{format_duration(run.predicted_s):>8}"
        )
    # a ladder trains its stable runs plus the branches' cooldowns, not every branch's full length
    total_flops = ladder_flops(plan.runs)[0] if plan.spec.mode == "ladder" else sum(run.flops for run in plan.runs)
    total_s = sum(run.predicted_s for run in plan.runs)
    lines.append("-" * len(header))
    lines.append(f"total: {len(plan.runs)} runs, {sum(r.tokens for r in plan.runs):,} tokens, {total_flops:.3g} FLOPs, "
                 f"predicted {format_duration(total_s)} on this machine (throughput model: "
                 f"{plan.spec.throughput.flops_per_s:.3g} FLOP/s, {plan.spec.throughput.step_overhead_s} s/step "
                 f"overhead, {plan.spec.throughput.startup_s:.0f} s startup)")
    if plan.spec.mode == "ladder":
        lines.extend(ladder_lines(plan.spec, plan.runs))
    lines.extend(shape_lines(plan))
    lines.extend(_lr_check_lines(plan, spec_path))
    if plan.train_tokens:
        lines.append(f"corpus: {plan.train_tokens:,} training tokens")
    lines.extend(f"warning: {warning}" for warning in plan.warnings)
    return "\n".join(lines) + "\n"


def shape_lines(plan: SweepPlan) -> list[str]:
    """The ladder's shapes, smallest first: depth, width, heads, N, and the aspect ratio hidden/layers."""
    from scaletrain.scaling.sweep.plan import shape_label

    rungs = {shape_label(run.shape): run for run in sorted(plan.runs, key=lambda run: run.counts.total_params)}
    lines = ["shapes (smallest first):"]
    lines += [f"  {label:<18} layers {run.shape.num_layers:>3}, hidden {run.shape.hidden_size:>5}, "
              f"heads {run.shape.num_heads:>3}: {run.counts.total_params:>12,} parameters "
              f"({run.counts.non_embedding_params:,} non-embedding), hidden/layers "
              f"{run.shape.hidden_size / run.shape.num_layers:.3g}" for label, run in rungs.items()]
    return lines


def _lr_check_lines(plan: SweepPlan, spec_path: str) -> list[str]:
    """The verdict of `tune.check`, or that it has not run (nothing without a check)."""
    from scaletrain.scaling.sweep.hyperparams import rules_to_show
    from scaletrain.scaling.sweep.lr_check import check_line

    line = check_line(plan.spec, rules_to_show(plan.spec.hyperparameters, plan.spec.dir, spec_path)[0], spec_path)
    return [] if line is None else [line]


def format_status(sweep_dir: Path, rows: list[dict], planned_s: dict[str, float | None] | None = None) -> str:
    """One line per run: a finished run's steps, any other's progress (latest logged step / total), its wall
    time and the plan's (`planned_s`, by name: the throughput model's predicted_s); then the counts and
    how the finished runs' time compares with the plan (time_line)."""
    planned_s = planned_s or {}
    lines = [f"{'run':<34} {'status':<8} {'steps':>16} {'val_loss':>9} {'train_loss':>10} {'wall':>8} {'planned':>8}"]
    for row in rows:
        val = f"{row['val_loss']:.4f}" if row["val_loss"] is not None else "-"
        train = f"{row['train_loss']:.4f}" if row["train_loss"] is not None else "-"
        wall = format_duration(row["wall_s"]) if row["wall_s"] else "-"
        planned = format_duration(planned_s[row["name"]]) if planned_s.get(row["name"]) else "-"
        steps = row["steps"] if row["status"] == "done" else _progress(sweep_dir / RUNS_DIR / row["name"], row["steps"])
        lines.append(f"{row['name']:<34} {row['status']:<8} {steps:>16} {val:>9} {train:>10} {wall:>8} {planned:>8}")
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines.append(", ".join(f"{count} {state}" for state, count in sorted(counts.items())) +
                 f"; table in {sweep_dir / RESULTS_FILE}")
    timing = time_line(rows, planned_s)
    return "\n".join(lines + ([timing] if timing else [])) + "\n"


def time_line(rows: list[dict], planned_s: dict[str, float | None]) -> str | None:
    """How long the finished runs took against the plan's throughput model, and the unfinished runs' planned
    time scaled by that ratio: the sweep's remaining time, one run at a time (None before a run finishes
    with both times known). A run's wall time sums its recorded attempts (an attempt whose `sweep run` was
    killed records none)."""
    finished = [row for row in rows if row["status"] == "done" and row["wall_s"] and planned_s.get(row["name"])]
    if not finished:
        return None
    wall, planned = sum(row["wall_s"] for row in finished), sum(planned_s[row["name"]] for row in finished)
    ratio = wall / planned
    rest = sum(planned_s.get(row["name"]) or 0.0 for row in rows if row["status"] != "done")
    line = (f"time: {len(finished)} finished run{'s' if len(finished) > 1 else ''} took {format_duration(wall)} "
            f"against the plan's {format_duration(planned)} ({ratio:.2f}x)")
    if rest:
        line += (f"; the unfinished runs are planned at {format_duration(rest)}, about {format_duration(rest * ratio)} "
                 "at that rate, one run at a time (divide by `--jobs`)")
    return line


def _progress(run_dir: Path, total_steps: int) -> str:
    """`120/1000 12%`: the latest step the run logged (metrics.jsonl) of its planned steps, rounded down."""
    from scaletrain.scaling.sweep.results import latest_logged_step

    step = latest_logged_step(run_dir / "metrics.jsonl")
    return f"{step}/{total_steps} {100 * step // total_steps}%"
