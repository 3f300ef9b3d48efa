"""In-loop downstream evaluation (eval.tasks, train/hooks/downstream.py): the numbers it logs at a step are those of
`scaletrain eval RUN --tasks ... --checkpoint STEP`, in one process and with two data-parallel or tensor-parallel
ranks, two tensor-parallel ranks under sequence parallelism, two data-parallel ranks under ZeRO-3 and a mixture of
experts split over two ranks (where every forward is a collective of the data-parallel ranks, so each scores every
document), and the last step's are in the run's summary.json; a run that evaluates trains the same losses, bit for
bit, as one that does not; under sequence parallelism batches of odd length score as under plain TP; a missing
lm-eval, a layout it cannot score in, a generate_until task under sequence parallelism and an unknown task are each
refused in one line before the first step."""

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
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    TrainedAhead,
    launcher,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

TAG = "scaletrain_shakespeare"
LIMIT = 12
STEPS, EVERY = 4, 2
# layout -> (ranks, overrides)
# 4 experts of width 32, top-2 (tests/train/test_moe_layouts.py's)
MOE = ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=32", "model.moe.capacity_factor=1.0"]
LAYOUTS = {"tp1": (1, []), "dp2": (2, []), "tp2": (2, ["parallel.tensor=2"]),
           "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
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
    ("parallel.context=2", "not with parallel.context=2"),
])
def test_layouts_the_loop_cannot_score_in_are_refused_at_load(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(DEMO_CONFIG, [f"eval.tasks=[{TAG}]", "tracking.wandb=disabled", override])
    assert fragment in str(error.value) and "scaletrain eval RUN --tasks" in str(error.value)
    sequence_parallel = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
    assert load_config(DEMO_CONFIG, [f"eval.tasks=[{TAG}]", "tracking.wandb=disabled", *sequence_parallel]).eval.tasks


# (context, continuation) lengths; the inputs (both less the last token), longest first in batches of 4: 15, 12, 9,
# 6 | 5, 3, 1, each batch's longest odd, which the sequence-parallel forward cannot split over 2 ranks unpadded
SP_REQUEST_LENGTHS = [(12, 4), (10, 3), (2, 8), (5, 2), (4, 2), (1, 3), (1, 1)]


def _scores_with_and_without_sequence_parallelism(rank: int, world_size: int, family: str) -> dict:
    """One model's weights at TP=2, with and without parallel.sequence_parallel: the Scorer's log-likelihoods of
    requests whose batches are of odd length, and whether the SP forward takes an odd length unpadded."""
    import dataclasses
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state

    from scaletrain.config_loader import config_from_dict, validate
    from scaletrain.evaluation.scoring import Scorer
    from scaletrain.families import build_model
    from scaletrain.parallel.sequence_parallel import enable_cpu_sequence_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    enable_cpu_sequence_parallel()
    sequence_parallel = config_from_dict({
        "model": {"family": family, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16},
        "data": {"vocab_size": 400, "num_sentinels": 4}, "parallel": {"tensor": 2, "sequence_parallel": True}})
    validate(sequence_parallel)
    plain = dataclasses.replace(sequence_parallel,
                                parallel=dataclasses.replace(sequence_parallel.parallel, sequence_parallel=False))
    torch.manual_seed(0)
    sp_model = build_model(sequence_parallel)
    tp_model = build_model(plain)
    tp_model.load_state_dict(sp_model.state_dict())
    generator = torch.Generator().manual_seed(1)
    requests = [tuple(torch.randint(4, 400, (length,), generator=generator).tolist() for length in lengths)
                for lengths in SP_REQUEST_LENGTHS]
    tokenizer, device = SimpleNamespace(pad_id=0), torch.device("cpu")
    try:
        sp_model.eval()(torch.tensor([(requests[0][0] + requests[0][1])[:15]]))
        odd_length_runs_unpadded = True
    except AssertionError:  # megatron: the first dimension is not divisible by the tensor-parallel size
        odd_length_runs_unpadded = False
    return {"sp": Scorer(sp_model, sequence_parallel, tokenizer, device, 4).loglikelihoods(requests),
            "tp": Scorer(tp_model, plain, tokenizer, device, 4).loglikelihoods(requests),
            "odd_length_runs_unpadded": odd_length_runs_unpadded}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_sequence_parallelism_scores_odd_lengths_as_tensor_parallelism_does(family: str) -> None:
    """The Scorer pads each batch to a multiple of the TP size under SP, and the log-likelihoods and greedy flags
    are plain TP's: causal attention leaves the real positions as they were, and the SP output layer gathers the
    whole sequence's logits."""
    from tests.distributed.harness import run_on_ranks

    for result in run_on_ranks(_scores_with_and_without_sequence_parallelism, 2, family):
        assert not result["odd_length_runs_unpadded"]
        sp, tp = result["sp"], result["tp"]
        assert [greedy for _, greedy in sp] == [greedy for _, greedy in tp]
        assert [score for score, _ in sp] == pytest.approx([score for score, _ in tp], rel=1e-6, abs=1e-5)


def _write_generation_and_scoring_tasks(directory: Path) -> Path:
    """A directory of two local tasks on one record: tiny_generation (generate_until) and tiny_scoring
    (loglikelihood)."""
    directory.mkdir()
    data = directory / "tiny.jsonl"
    data.write_text('{"context": "to be or not to ", "target": "be"}\n')
    common = (f"dataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
              "doc_to_text: context\ndoc_to_target: target\n")
    (directory / "tiny_generation.yaml").write_text(
        f"task: tiny_generation\n{common}output_type: generate_until\ngeneration_kwargs: {{max_gen_toks: 4}}\n"
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n")
    (directory / "tiny_scoring.yaml").write_text(
        f"task: tiny_scoring\n{common}output_type: loglikelihood\n"
        "metric_list: [{metric: perplexity, aggregation: perplexity, higher_is_better: false}]\n")
    return directory


def test_a_generate_until_task_under_sequence_parallelism_is_refused_in_one_line_before_step_1(
        small_dataset: Path, tmp_path: Path) -> None:
    """Sequence parallelism scores (tp2_sp above) but cannot generate; the scoring task beside it is not named."""
    run_dir, tasks = tmp_path / "run", _write_generation_and_scoring_tasks(tmp_path / "tasks")
    result = subprocess.run(
        [*launcher(2), "train", str(DEMO_CONFIG), *_train_overrides(small_dataset, run_dir), *LAYOUTS["tp2_sp"][1],
         f"eval.tasks=[{tasks}]"], cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("scaletrain train: error:")]
    assert result.returncode != 0 and errors == [
        "scaletrain train: error: eval.tasks: tiny_generation (output_type generate_until) cannot run under "
        "parallel.sequence_parallel: generation decodes one token per forward behind a KV cache, and sequence "
        "parallelism splits every forward's sequence over the tensor-parallel ranks; leave tiny_generation out of "
        "eval.tasks, or train without parallel.sequence_parallel and score the run's checkpoints with `scaletrain "
        "eval RUN --tasks ...`"
    ], result.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*"))
    assert not (run_dir / "metrics.jsonl").exists() or '"loss"' not in (run_dir / "metrics.jsonl").read_text()


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
