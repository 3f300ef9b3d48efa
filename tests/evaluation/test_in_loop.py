"""In-loop downstream evaluation (eval.tasks, train/hooks/downstream.py): the numbers it logs at a step are those of
`scaletrain eval RUN --tasks ... --checkpoint STEP`, in one process and with two data-parallel or tensor-parallel
ranks, two tensor-parallel ranks under sequence parallelism, two pipeline stages, two context-parallel ranks, two
data-parallel ranks under ZeRO-3 and a mixture of experts split over two ranks (where every forward is a collective
of the data-parallel ranks, so each scores every document), and the last step's are in the run's summary.json; the
offline command under torchrun scores the two-stage run in its stages, with the same numbers; a run that evaluates
trains the same losses, bit for bit, as one that does not; under sequence and context parallelism and in pipeline
stages the Scorer scores batches of odd length as one model does; a missing lm-eval, a generate_until task in a
layout that cannot generate and an unknown task are each refused in one line before the first step."""

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
           "pp2": (2, ["parallel.pipeline=2"]), "cp2": (2, ["parallel.context=2"]),
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
    if layout == "pp2":  # the offline command in the run's own stages
        stdout = run_scaletrain("eval", [str(run_dir), "--tasks", TAG, "--include-path", str(task_yamls), "--limit",
                                         str(LIMIT), "--batch-size", "4", "--bootstrap-iters", "0", "--out",
                                         str(tmp_path / "staged")], nproc=2)
        staged = json.loads(Path(stdout.splitlines()[-1].removeprefix("wrote ")).read_text())
        assert staged["config"]["scaletrain"]["pipeline_parallel"] == 2
        assert downstream_metrics(staged) == pytest.approx(expected, rel=1e-6, abs=1e-6)
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


# (context, continuation) lengths; the inputs (both less the last token), longest first in batches of 4: 15, 12, 9,
# 6 | 5, 3, 1, each batch's longest odd, which the sequence-parallel forward cannot split over 2 ranks unpadded (nor
# the context-parallel one over 2 x 2 chunks)
REQUEST_LENGTHS = [(12, 4), (10, 3), (2, 8), (5, 2), (4, 2), (1, 3), (1, 1)]
# layout -> (the parallel section of the model scored over 2 ranks, that of the reference it must score as): under
# sequence parallelism plain TP=2, under pipeline stages and context parallelism one whole model on each rank
SCORING_LAYOUTS = {"sp": ({"tensor": 2, "sequence_parallel": True}, {"tensor": 2}),
                   "pp": ({"pipeline": 2}, {}), "cp": ({"context": 2}, {})}
# family -> its model section beyond the shared keys
SCORING_FAMILIES = {"gpt": {}, "llama": {}, "t5": {"num_decoder_layers": 2}, "bart": {"num_decoder_layers": 2}}


def _scorer_in_layout(family: str, parallel: dict, state: dict | None) -> tuple:
    """The Scorer of a 2-layer `family` model in the layout `parallel` on this rank (megatron's groups made for
    it), with the weights `state` (the model's names) or, if None, seeded ones; (scorer, the whole model's state)."""
    from types import SimpleNamespace

    import torch

    from scaletrain.checkpoint.layout_free import pipeline_to_model_name
    from scaletrain.config_loader import config_from_dict, validate
    from scaletrain.evaluation.scoring import Scorer
    from scaletrain.families import build_model, get_family
    from scaletrain.model.pipeline import build_pipeline
    from scaletrain.parallel.groups import init_distributed
    from scaletrain.parallel.layout import resolve_for_world

    config = config_from_dict({
        "model": {"family": family, "num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": 16,
                  **SCORING_FAMILIES[family]},
        "data": {"vocab_size": 400, "num_sentinels": 4}, "parallel": parallel})
    validate(config)
    config = resolve_for_world(config, 2)
    topology = init_distributed(config)
    torch.manual_seed(0)
    if config.parallel.pipeline > 1:
        model = build_pipeline(config, topology, get_family(family))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(state[pipeline_to_model_name(name)])
    else:
        model = build_model(config)
        if state is not None:
            model.load_state_dict(state)
    tokenizer = SimpleNamespace(pad_id=0, eos_id=3, bos_id=2)
    return Scorer(model, config, tokenizer, torch.device("cpu"), 4), model.state_dict()


def _scores_in_layout(rank: int, world_size: int, family: str, layout: str) -> dict:
    """One model's weights in the layout and in its reference: the Scorer's log-likelihoods of requests whose
    batches are of odd length, and (sequence parallelism) whether the forward takes an odd length unpadded."""
    import torch
    from megatron.core import parallel_state

    parallel, reference_parallel = SCORING_LAYOUTS[layout]
    generator = torch.Generator().manual_seed(1)
    requests = [tuple(torch.randint(4, 400, (length,), generator=generator).tolist() for length in lengths)
                for lengths in REQUEST_LENGTHS]
    reference, state = _scorer_in_layout(family, reference_parallel, None)
    expected = reference.loglikelihoods(requests)
    parallel_state.destroy_model_parallel()
    scorer, _ = _scorer_in_layout(family, parallel, state)
    odd_length_runs_unpadded = None
    if layout == "sp":
        try:
            scorer.model.eval()(torch.tensor([(requests[0][0] + requests[0][1])[:15]]))
            odd_length_runs_unpadded = True
        except AssertionError:  # megatron: the first dimension is not divisible by the tensor-parallel size
            odd_length_runs_unpadded = False
    return {"layout": scorer.loglikelihoods(requests), "reference": expected,
            "odd_length_runs_unpadded": odd_length_runs_unpadded,
            "parameters": [sum(parameter.numel() for parameter in scorer_or_reference.model.parameters())
                           for scorer_or_reference in (scorer, reference)]}


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("gpt", "sp"), ("llama", "sp"), ("gpt", "pp"), ("llama", "pp"),
                                            ("t5", "pp"), ("bart", "pp"), ("gpt", "cp"), ("llama", "cp")])
def test_sequence_context_and_pipeline_parallelism_score_as_one_model_does(family: str, layout: str) -> None:
    """Over 2 ranks, each batch of odd length: under sequence parallelism the Scorer pads it to a multiple of the
    TP size and scores as plain TP (causal attention leaves the real positions as they were, and the SP output
    layer gathers the whole sequence's logits); in 2 pipeline stages (the batch passed on, the last stage's scores
    sent back) and under context parallelism (padded to 2 x 2 chunks, each rank scoring its zigzag positions)
    every rank scores as the whole model in one process: the same log-likelihoods and greedy flags."""
    from tests.distributed.harness import run_on_ranks

    for result in run_on_ranks(_scores_in_layout, 2, family, layout):
        assert result["odd_length_runs_unpadded"] is (False if layout == "sp" else None)
        held, whole = result["parameters"]
        assert held < whole if layout == "pp" else held == whole  # a stage holds some of the layers
        scored, reference = result["layout"], result["reference"]
        assert [greedy for _, greedy in scored] == [greedy for _, greedy in reference]
        assert [score for score, _ in scored] == pytest.approx([score for score, _ in reference], rel=1e-6, abs=1e-5)


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
    assert result.returncode != 0 and errors == [f"scaletrain train: error: {_generation_refusal(*SP_BLOCKER)}"], \
        result.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*"))
    assert not (run_dir / "metrics.jsonl").exists() or '"loss"' not in (run_dir / "metrics.jsonl").read_text()


SP_BLOCKER = ("parallel.sequence_parallel", "sequence parallelism splits every forward's sequence over the "
                                            "tensor-parallel ranks")


def _generation_refusal(setting: str, why: str) -> str:
    return (f"eval.tasks: tiny_generation (output_type generate_until) cannot run under {setting}: generation "
            f"decodes one token per forward behind a KV cache, and {why}; leave tiny_generation out of eval.tasks "
            "and score the run's checkpoints with `scaletrain eval RUN --tasks tiny_generation`, which generates in "
            "a layout without it")


@pytest.mark.parametrize("layout, setting, why", [
    ("pp2", "parallel.pipeline=2", "the model's layers are split over pipeline stages"),
    ("cp2", "parallel.context=2", "context parallelism splits every forward's sequence over the context-parallel "
                                  "ranks"),
    ("tp2_sp", *SP_BLOCKER),
])
def test_layouts_that_cannot_generate_refuse_generate_until_tasks_and_score_the_others(
        layout: str, setting: str, why: str, tmp_path: Path) -> None:
    """What the hook checks before the first step (end to end for SP above): the generating task is refused in one
    line; the scoring task alone passes, in each layout, and in a layout that generates both do."""
    from scaletrain.evaluation.downstream import harness_module
    from scaletrain.train.hooks.downstream import refuse_generation_where_it_cannot_run, selected_tasks

    tasks, harness = _write_generation_and_scoring_tasks(tmp_path / "tasks"), harness_module()
    config = load_config(DEMO_CONFIG, [f"eval.tasks=[{tasks}]", "tracking.wandb=disabled", *LAYOUTS[layout][1]])
    with pytest.raises(ConfigError) as error:
        refuse_generation_where_it_cannot_run(harness, selected_tasks(harness, config), config)
    assert str(error.value) == _generation_refusal(setting, why)
    scoring = load_config(DEMO_CONFIG, ["eval.tasks=[tiny_scoring]", f"eval.include_path=[{tasks}]",
                                        "tracking.wandb=disabled", *LAYOUTS[layout][1]])
    refuse_generation_where_it_cannot_run(harness, selected_tasks(harness, scoring), scoring)
    plain = load_config(DEMO_CONFIG, [f"eval.tasks=[{tasks}]", "tracking.wandb=disabled", "parallel.tensor=2"])
    refuse_generation_where_it_cannot_run(harness, selected_tasks(harness, plain), plain)


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
