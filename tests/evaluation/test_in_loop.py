"""In-loop downstream evaluation (eval.tasks, train/hooks/downstream.py): the numbers it logs at a step are those of
`scaletrain eval RUN --tasks ... --checkpoint STEP`, in one process and with two data-parallel or tensor-parallel
ranks, two data-parallel ranks under ZeRO-3 and a mixture of experts split over two ranks (where every forward is
a collective of the data-parallel ranks, so each scores every document), and the last step's are in the run's
summary.json; a run that evaluates trains the same losses, bit for bit,
as one that does not; a missing lm-eval, a layout it cannot score in and an unknown task are each refused in one
line before the first step."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config
from scaletrain.scaling.sweep import results as sweep_results
from scaletrain.train.hooks.downstream import downstream_metrics, lm_eval_limit
from tests.evaluation.test_downstream import TASKS, without_lm_eval, write_task_yamls
from tests.train.runs import DEMO_CONFIG, REPO, TrainedAhead, run_scaletrain, scaletrain_environment, tiny_overrides

TAG = "scaletrain_shakespeare"
LIMIT = 12
STEPS, EVERY = 4, 2
# layout -> (ranks, overrides)
# 4 experts of width 32, top-2 (tests/train/test_moe_layouts.py's)
MOE = ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=32", "model.moe.capacity_factor=1.0"]
LAYOUTS = {"tp1": (1, []), "dp2": (2, []), "tp2": (2, ["parallel.tensor=2"]),
           "dp2_zero3": (2, ["parallel.zero_stage=3"]), "ep2": (2, [*MOE, "parallel.expert=2"])}


@pytest.fixture(scope="module")
def task_yamls(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped configs/eval_tasks/shakespeare_*.yaml over data built from the small dataset's held-out split."""
    return write_task_yamls(small_dataset, tmp_path_factory.mktemp("in_loop_tasks"))


def _train_overrides(small_dataset: Path, run_dir: Path) -> list[str]:
    return [*tiny_overrides(small_dataset, run_dir), "model.ffn_hidden_size=128", "train.eval_every=0",
            f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep_last=4"]


@pytest.fixture(scope="module")
def runs(small_dataset: Path, task_yamls: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    """runs(layout, evaluating): the layout's 4-step run with eval.tasks every 2 steps ("yes") or without ("no")."""

    def train(key: tuple[str, str], run_dir: Path) -> Path:
        layout, evaluating = key
        nproc, extra = LAYOUTS[layout]
        tasks = [f"eval.tasks=[{TAG}]", f"eval.include_path=[{task_yamls}]", f"eval.every={EVERY}",
                 f"eval.limit={LIMIT}", "eval.batch_size=4"] if evaluating == "yes" else []
        run_scaletrain("train", [str(DEMO_CONFIG), *_train_overrides(small_dataset, run_dir), *extra, *tasks],
                       nproc=nproc)
        return run_dir

    keys = [(layout, evaluating) for layout in LAYOUTS for evaluating in ("yes", "no")]
    trained = TrainedAhead(train, lambda key: tmp_path_factory.mktemp("_".join(key)) / "run", keys)
    yield trained
    trained.close()


def _records(run_dir: Path) -> tuple[dict[int, float], dict[int, dict]]:
    """(training loss by step, downstream record by step)."""
    losses, downstream = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        if "eval/downstream/time_s" in record:
            downstream[record["step"]] = record
    return losses, downstream


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_loop_logs_what_the_offline_command_logs_at_that_step_and_trains_the_same(
        layout: str, runs: TrainedAhead, task_yamls: Path, tmp_path: Path) -> None:
    run_dir = runs(layout, "yes")
    losses, downstream = _records(run_dir)
    plain_losses, plain_downstream = _records(runs(layout, "no"))
    assert losses == plain_losses and len(losses) == STEPS and not plain_downstream  # bit for bit
    assert sorted(downstream) == [0, 2, 4]
    for step in (2, 4):
        stdout = run_scaletrain("eval", [str(run_dir), "--tasks", TAG, "--include-path", str(task_yamls),
                                         "--checkpoint", str(step), "--limit", str(LIMIT), "--batch-size", "4",
                                         "--bootstrap-iters", "0", "--out", str(tmp_path / str(step))])
        offline = json.loads(Path(stdout.splitlines()[-1].removeprefix("wrote ")).read_text())
        expected = downstream_metrics(offline)
        logged = {key: value for key, value in downstream[step].items()
                  if key not in ("step", "eval/downstream/time_s")}
        assert sorted(logged) == sorted(expected) and len(expected) >= 2 * len(TASKS), sorted(logged)
        assert logged == pytest.approx(expected, rel=1e-6, abs=1e-6), step
        for task in TASKS:
            assert offline["n-samples"][f"shakespeare_{task}"]["effective"] == LIMIT
        in_loop_json = next((run_dir / "eval" / f"step_{step:08d}").glob("results_*.json"))
        assert downstream_metrics(json.loads(in_loop_json.read_text())) == logged
    assert downstream[2]["eval/downstream/time_s"] > 0
    assert {"eval/downstream/shakespeare_next_line/acc", "eval/downstream/shakespeare_next_line/gold_loss",
            "eval/downstream/shakespeare_passages/bits_per_byte", "eval/downstream/shakespeare_cloze/acc",
            "eval/downstream/shakespeare_cloze/gold_loss"} <= downstream[4].keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {key: value for key, value in summary.items() if key.startswith("eval/downstream/")} == {
        key: value for key, value in downstream[STEPS].items() if key != "step"}
    without = {key: value for key, value in summary.items() if not key.startswith("eval/downstream/")}
    assert sweep_results.downstream_metrics(summary, run_dir / "metrics.jsonl") == sweep_results.downstream_metrics(
        without, run_dir / "metrics.jsonl")  # results.csv's columns: the same from either file


def test_without_lm_eval_a_run_with_eval_tasks_is_refused_in_one_line_before_step_1(small_dataset: Path,
                                                                                      tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [*without_lm_eval(tmp_path), "train", str(DEMO_CONFIG), *_train_overrides(small_dataset, run_dir),
         f"eval.tasks=[{TAG}]"], cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 2 and errors == [
        f"scaletrain train: error: eval.tasks=['{TAG}'] needs lm-evaluation-harness, which is not installed: pip "
        "install 'scaletrain[eval]' (or leave eval.tasks empty)"], result.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("override, fragment", [
    ("parallel.pipeline=2", "not with parallel.pipeline=2"),
    ("parallel.sequence_parallel=true", "not with parallel.sequence_parallel=true"),
    ("parallel.context=2", "not with parallel.context=2"),
])
def test_layouts_the_loop_cannot_score_in_are_refused_at_load(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(DEMO_CONFIG, [f"eval.tasks=[{TAG}]", "tracking.wandb=disabled", override])
    assert fragment in str(error.value) and "scaletrain eval RUN --tasks" in str(error.value)


def test_eval_keys_load_with_their_defaults_and_are_free_on_resume() -> None:
    from scaletrain.checkpoint.resume_policy import RESUME_FREE_KEYS

    config = load_config(DEMO_CONFIG, ["eval.tasks=[a, configs/eval_tasks]", "eval.every=100", "eval.limit=20"])
    assert (config.eval.tasks, config.eval.every, config.eval.limit, config.eval.batch_size) == (
        ["a", "configs/eval_tasks"], 100, 20.0, 8)
    assert load_config(DEMO_CONFIG).eval.tasks == [] and "eval." in RESUME_FREE_KEYS
    with pytest.raises(ConfigError, match="eval.limit=0.0 must be > 0"):
        load_config(DEMO_CONFIG, ["eval.limit=0"])


def test_metric_names_and_limits() -> None:
    results = {"results": {"t": {"alias": "t", "acc,none": 0.25, "acc_stderr,none": "N/A",
                                 "exact_match,strict-match": 1, "bits_per_byte,none": 2.5}}}
    assert downstream_metrics(results) == {"eval/downstream/t/acc": 0.25, "eval/downstream/t/exact_match/strict-match":
                                           1.0, "eval/downstream/t/bits_per_byte": 2.5}
    assert (lm_eval_limit(20.0), lm_eval_limit(0.5), lm_eval_limit(None)) == (20, 0.5, None)
