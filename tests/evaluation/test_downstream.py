"""`scaletrain eval RUN --tasks`: lm-evaluation-harness on scaletrain's own model, as a user runs it.

On each local task (configs/eval_tasks/, its data built by `scaletrain eval-tasks build`) the backend's
log-likelihoods equal a direct computation with the model and lm-eval's own `hf` backend on the run's export, within
1e-4, and so does gold_loss (configs/eval_tasks/metrics.py) of the next-line and cloze tasks, for GPT, Llama and T5
runs trained at TP=2 and scored in one process (TP=1) and under torchrun at TP=2, and for BART in one process;
generate_until writes what `scaletrain generate` writes; a missing lm-eval and an encoder family each get one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_on_ranks
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    WARM_CLIENT,
    TrainedAhead,
    launcher,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)
from tests.warm import SCRIPT

# family -> (config, its overrides, the TP size its run trains with)
FAMILIES = {
    "gpt": ("gpt_tiny.yaml", [], 2),
    "llama": ("llama_tiny.yaml", ["model.num_kv_heads=2"], 2),
    # Tied embeddings: lm-eval 0.4.13's hf backend calls tie_weights() on the model it loaded, and transformers
    # 5's T5Config always asks for tied weights, so there an untied (v1.1) export is scored with its embedding as
    # its lm_head. The scaletrain backend scores either.
    "t5": ("t5_tiny.yaml", ["model.num_decoder_layers=2", "model.tie_embeddings=true"], 2),
    "bart": ("bart_tiny.yaml", ["model.num_decoder_layers=2"], 1),  # scored by 2 data-parallel ranks
    "bert": ("bert_tiny.yaml", ["train.steps=1", "train.warmup_steps=0"], 1),
}
TASKS = ("passages", "next_line", "cloze")
GOLD_LOSS_TASKS = ("next_line", "cloze")  # their gold continuation: the labelled choice, the target word
TAG = "scaletrain_shakespeare"  # the shipped YAMLs' tag for the three
SEQ_LENGTH = 64
EOS_ID = 3
RECORDS = 16  # per task
TOLERANCE = 1e-4


def _close(value: float, reference: float) -> bool:
    """Within TOLERANCE, or TOLERANCE per 100 nats for a long text's sum: fp32 log-probabilities summed over a few
    hundred tokens in another order (another batch, TP split, library) differ by about that much."""
    return abs(value - reference) <= TOLERANCE * max(1.0, abs(reference) / 100)


def write_task_yamls(small_dataset: Path, root: Path) -> Path:
    """A directory of task YAMLs that include the shipped configs/eval_tasks/shakespeare_*.yaml, each reading the
    data `scaletrain eval-tasks build` wrote from the small dataset's held-out split (and caching it there)."""
    run_scaletrain("eval-tasks", ["build", str(DEMO_CONFIG), f"data.dir={small_dataset}", "--out", str(root / "data"),
                                  "--count", str(RECORDS)])
    (root / "yaml").mkdir()
    for task in TASKS:
        (root / "yaml" / f"shakespeare_{task}.yaml").write_text(
            f"include: {REPO / 'configs' / 'eval_tasks' / f'shakespeare_{task}.yaml'}\n"
            f"task: shakespeare_{task}\n"
            f"dataset_kwargs: {{data_files: {{test: {root / 'data' / task}.jsonl}}, cache_dir: {root / 'cache'}}}\n")
    return root / "yaml"


@pytest.fixture(scope="module")
def task_yamls(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_task_yamls(small_dataset, tmp_path_factory.mktemp("eval_tasks"))


@pytest.fixture(scope="module")
def trained(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    """trained(family): the family's 6-step run (BERT: one step), the next family's training meanwhile."""

    def train(key: tuple[str], run_dir: Path) -> Path:
        (family,) = key
        config, extra, tensor = FAMILIES[family]
        run_scaletrain("train", [str(REPO / "configs" / config), *tiny_overrides(small_dataset, run_dir),
                                 f"model.seq_length={SEQ_LENGTH}", "model.ffn_hidden_size=128", "train.eval_every=0",
                                 "train.steps=6", "checkpoint.every=6", f"parallel.tensor={tensor}", *extra],
                       nproc=tensor)
        return run_dir

    runs = TrainedAhead(train, lambda key: tmp_path_factory.mktemp(key[0]) / "run", [(name,) for name in FAMILIES])
    yield runs
    runs.close()


def _eval_tasks(run_dir: Path, yamls: Path, nproc: int, *options: str) -> tuple[str, Path]:
    """`scaletrain eval RUN --tasks TAG` with its samples logged: (stdout, the results JSON's directory)."""
    stdout = run_scaletrain("eval", [str(run_dir), "--tasks", TAG, "--include-path", str(yamls), "--bootstrap-iters",
                                     "0", "--log-samples", *options], nproc=nproc)
    return stdout, Path(stdout.splitlines()[-1].removeprefix("wrote ")).parent


def _scores(samples: list[dict]) -> dict[int, list[tuple[float, bool | None]]]:
    """doc_id -> (log-likelihood, is_greedy or None for a rolling one) of each of its requests."""
    def score(response: list) -> tuple[float, bool | None]:
        value = response[0]
        return (value[0], value[1]) if isinstance(value, list | tuple) else (value, None)

    return {sample["doc_id"]: [score(response) for response in sample["resps"]] for sample in samples}


def _ours(results_dir: Path) -> dict[str, dict[int, list[tuple[float, bool | None]]]]:
    return {task: _scores([json.loads(line) for line in next(results_dir.glob(f"samples_shakespeare_{task}_*"))
                           .read_text().splitlines()]) for task in TASKS}


@pytest.fixture(scope="module")
def references(trained: TrainedAhead, task_yamls: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[[str], tuple[dict, dict, dict, dict]]:
    """references(family): (lm-eval's hf backend's scores on the export of the family's run, its metrics, the
    direct computation's scores, the documents by task and id), computed once per family."""
    computed = {}

    def reference(family: str) -> tuple[dict, dict, dict, dict]:
        if family not in computed:
            computed[family] = _reference(trained(family), task_yamls, tmp_path_factory.mktemp(f"{family}_reference"))
        return computed[family]

    return reference


def _reference(run_dir: Path, yamls: Path, tmp_dir: Path) -> tuple[dict, dict, dict, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from scaletrain.evaluation.harness import hf_model_args

    export = tmp_dir / "hf"
    run_scaletrain("export", [str(run_dir), str(export)])
    config = json.loads((export / "config.json").read_text())
    results = simple_evaluate(
        model="hf", model_args=hf_model_args(export, config.get("is_encoder_decoder", False), SEQ_LENGTH, EOS_ID),
        tasks=[TAG], task_manager=TaskManager(include_path=str(yamls), include_defaults=False), bootstrap_iters=0,
        log_samples=True, device="cpu", batch_size=4)
    samples = results["samples"]
    hf = {task: _scores(samples[f"shakespeare_{task}"]) for task in TASKS}
    requests = {task: {sample["doc_id"]: [list(arguments) for arguments in sample["arguments"]]
                       for sample in samples[f"shakespeare_{task}"]} for task in TASKS}
    direct = run_on_ranks(_direct_scores, 1, run_dir, requests)[0]
    documents = {task: {sample["doc_id"]: sample["doc"] for sample in samples[f"shakespeare_{task}"]}
                 for task in TASKS}
    return hf, results["results"], direct, documents


def _direct_gold_loss(task: str, direct: dict, documents: dict) -> float:
    """The mean over documents of the gold continuation's -log-likelihood (direct computation) per UTF-8 byte, in
    bits: the next-line task's labelled choice, the cloze task's target word."""
    losses = []
    for doc, document in documents[task].items():
        if task == "next_line":
            gold, (loglikelihood, _) = document["choices"][document["label"]], direct[task][doc][document["label"]]
        else:
            gold, ((loglikelihood, _),) = document["target"], direct[task][doc]
        losses.append(-loglikelihood / (math.log(2) * len(gold.encode("utf-8"))))
    return sum(losses) / len(losses)


def _direct_scores(rank: int, world_size: int, run_dir: Path, requests: dict) -> dict:
    """Each request's log-likelihood from plain forwards of the whole (TP=1) model, one request at a time: lm-eval's
    TemplateLM cuts the text into context and continuation ids, the rolling windows are lm-eval's."""
    from lm_eval import utils
    from megatron.core import parallel_state

    from scaletrain.checkpoint.format import latest_checkpoint
    from scaletrain.data.storage import dataset_location
    from scaletrain.data.tokenizer import Tokenizer
    from scaletrain.evaluation.harness import ScaletrainLM
    from scaletrain.evaluation.scoring import Scorer
    from scaletrain.generate import load_model
    from scaletrain.run_config import run_config

    parallel_state.initialize_model_parallel()
    config = run_config(run_dir)
    model = load_model(config, latest_checkpoint(run_dir))
    lm = ScaletrainLM(Scorer(model, config, Tokenizer.load(dataset_location(config.data).tokenizer_path()),
                             torch.device("cpu")))
    start = lm.scorer.generation.decoder_start_id(lm.scorer.tokenizer) if lm.scorer.encoder_decoder else None

    def pairs(arguments: list[str]) -> list[tuple[list[int], list[int]]]:
        if len(arguments) == 1:  # a rolling text
            windows = utils.get_rolling_token_windows(lm.tok_encode(arguments[0]), prefix_token=EOS_ID,
                                                      max_seq_len=SEQ_LENGTH, context_len=1)
            return [utils.make_disjoint_window(window) for window in windows]
        return [lm._encode_pair(*arguments)]

    return {task: {doc: [(sum(_direct(model, start, *pair) for pair in pairs(arguments)), None)
                         for arguments in doc_requests] for doc, doc_requests in task_requests.items()}
            for task, task_requests in requests.items()}


def _direct(model: torch.nn.Module, start: int | None, context: list[int], continuation: list[int]) -> float:
    """The continuation's log-probability: a decoder reads the last SEQ_LENGTH tokens of context + continuation
    (less the last), an encoder-decoder the last SEQ_LENGTH of the context and the continuation behind `start`."""
    with torch.no_grad():
        if start is None:
            tokens = (context + continuation)[-(SEQ_LENGTH + 1):]
            logits = model(torch.tensor([tokens[:-1]]))[0, -len(continuation):]
        else:
            logits = model(encoder_tokens=torch.tensor([context[-SEQ_LENGTH:]]),
                           decoder_tokens=torch.tensor([[start, *continuation[:-1]]]))[0]
    return float(torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(continuation)[:, None]).sum())


@pytest.mark.slow
@pytest.mark.parametrize("family, nproc", [("gpt", 1), ("gpt", 2), ("llama", 1), ("llama", 2), ("t5", 1), ("t5", 2),
                                           ("bart", 2)])
def test_scores_equal_a_direct_computation_and_the_hf_backend_on_the_export(
        family: str, nproc: int, trained: TrainedAhead, task_yamls: Path, references: Callable, tmp_path: Path
) -> None:
    """Scored by `nproc` ranks in the run's TP layout, the rest data-parallel (BART: TP=1, 2 replicas sharing the
    documents). In one process the results go to RUN/eval/step_NNNNNNNN; under torchrun, of --checkpoint 6, to
    --out."""
    run_dir = trained(family)
    options = ["--checkpoint", "6", "--out", str(tmp_path)] if nproc == 2 else []
    stdout, results_dir = _eval_tasks(run_dir, task_yamls, nproc, *options)
    hf, hf_metrics, direct, documents = references(family)
    assert results_dir == (tmp_path if nproc == 2 else run_dir / "eval" / "step_00000006")
    results = json.loads(next(results_dir.glob("results_*.json")).read_text())
    tensor = min(nproc, FAMILIES[family][2])
    assert (results["config"]["scaletrain"]["tensor_parallel"], results["config"]["scaletrain"]["data_parallel"]) == (
        tensor, nproc // tensor)
    for task, ours in _ours(results_dir).items():
        assert len(ours) == RECORDS and ours.keys() == hf[task].keys() == direct[task].keys()
        for doc, scores in ours.items():
            for (value, greedy), (hf_value, hf_greedy), (direct_value, _) in zip(
                    scores, hf[task][doc], direct[task][doc], strict=True):
                assert _close(value, hf_value) and _close(value, direct_value), (task, doc, value, hf_value)
                assert greedy == hf_greedy
        metrics = {key: value for key, value in results["results"][f"shakespeare_{task}"].items()
                   if "," in key and "_stderr," not in key}
        assert metrics == pytest.approx({key: hf_metrics[f"shakespeare_{task}"][key] for key in metrics}, rel=1e-5)
        if task in GOLD_LOSS_TASKS:
            assert metrics["gold_loss,none"] == pytest.approx(_direct_gold_loss(task, direct, documents), abs=TOLERANCE)
        assert f"shakespeare_{task}: " in stdout and f"({RECORDS} documents)" in stdout


def _generate(run_dir: Path, *options: str) -> str:
    return run_scaletrain("generate", [str(run_dir), "--prompt", "KING:", "--max-new-tokens", "24", *options])


def _generate_until(rank: int, world_size: int, run_dir: Path, requests: list[tuple[str, dict]]) -> list[str]:
    from lm_eval.api.instance import Instance
    from megatron.core import parallel_state

    from scaletrain.checkpoint.format import latest_checkpoint
    from scaletrain.data.storage import dataset_location
    from scaletrain.data.tokenizer import Tokenizer
    from scaletrain.evaluation.harness import ScaletrainLM
    from scaletrain.evaluation.scoring import Scorer
    from scaletrain.generate import load_model
    from scaletrain.run_config import run_config

    parallel_state.initialize_model_parallel()
    config = run_config(run_dir)
    scorer = Scorer(load_model(config, latest_checkpoint(run_dir)), config,
                    Tokenizer.load(dataset_location(config.data).tokenizer_path()), torch.device("cpu"))
    instances = [Instance("generate_until", {}, arguments, index) for index, arguments in enumerate(requests)]
    return ScaletrainLM(scorer).generate_until(instances)


@pytest.mark.slow
def test_generate_until_writes_what_scaletrain_generate_writes(trained: TrainedAhead) -> None:
    """Greedy, and sampled with the same seed (a text long enough to cut at a stop sequence)."""
    run_dir = trained("gpt")
    greedy, sampled = _generate(run_dir, "--temperature", "0")[:-1], _generate(run_dir, "--temperature", "0.8")[:-1]
    stop = sampled[len("KING:"):][3:5]
    written = run_on_ranks(_generate_until, 1, run_dir, [
        ("KING:", {"until": [], "max_gen_toks": 24}),
        ("KING:", {"until": [], "max_gen_toks": 24, "do_sample": True, "temperature": 0.8, "top_k": 50}),
        ("KING:", {"until": [stop], "max_gen_toks": 24, "do_sample": True, "temperature": 0.8, "top_k": 50})])[0]
    assert ["KING:" + text for text in written[:2]] == [greedy, sampled]
    assert written[2] == sampled[len("KING:"):].split(stop)[0] and len(set(sampled)) > 3


@pytest.mark.slow
def test_an_encoder_family_is_refused_in_one_line(trained: TrainedAhead, task_yamls: Path) -> None:
    run_dir = trained("bert")
    result = subprocess.run([*launcher(1), "eval", str(run_dir), "--tasks", TAG, "--include-path", str(task_yamls)],
                            cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"scaletrain eval: error: {run_dir} trained a bert model, which "
                                    "lm-evaluation-harness cannot evaluate: its tasks score or generate text left to "
                                    "right, and BERT is a masked LM")


HIDE_LM_EVAL = """import sys


class HideLMEval:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "lm_eval":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, HideLMEval())
"""


def without_lm_eval(directory: Path) -> list[str]:
    """`python -m scaletrain` whose `import lm_eval` fails, as where the extra is not installed: a script that
    hides it, then runs the CLI, in a warm fork (tests/warm.py), whose server has not imported lm-eval. A
    fresh interpreter with the finder in a sitecustomize imported torch & co. (~5 s) for each of these."""
    script = directory / "without_lm_eval.py"
    script.write_text(f"{HIDE_LM_EVAL}\nimport runpy\n\nrunpy.run_module('scaletrain', run_name='__main__')\n")
    return [sys.executable, str(WARM_CLIENT), SCRIPT, str(script)]


def test_without_lm_eval_eval_tasks_says_how_to_install_it(tmp_path: Path) -> None:
    """Where the extra is not installed (without_lm_eval)."""
    result = subprocess.run([*without_lm_eval(tmp_path), "eval", str(tmp_path / "run"), "--tasks", TAG],
                            cwd=REPO, env=scaletrain_environment(), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, "scaletrain eval: error: lm-evaluation-harness is not "
                                                     "installed: pip install 'scaletrain[eval]'\n")


def test_a_local_task_whose_data_file_is_missing_is_refused_naming_it(tmp_path: Path) -> None:
    """By its YAML file, its name, its tag or its directory, before anything is scored (in the loop, scoring comes
    after training)."""
    from scaletrain.evaluation.harness import select_tasks

    tasks, data = tmp_path / "tasks", tmp_path / "cloze.jsonl"
    tasks.mkdir()
    (tasks / "tiny_cloze.yaml").write_text(
        f"include: {REPO / 'configs' / 'eval_tasks' / 'shakespeare_cloze.yaml'}\ntask: tiny_cloze\ntag: tiny_tag\n"
        f"dataset_kwargs: {{data_files: {{test: {data}}}}}\n")
    ways = [([str(tasks / "tiny_cloze.yaml")], []), (["tiny_cloze"], [tasks]), (["tiny_tag"], [tasks]),
            ([str(tasks)], [])]
    for names, include in ways:
        with pytest.raises(ValueError) as error:
            select_tasks(names, include)
        assert str(error.value).startswith(f"--tasks {tasks / 'tiny_cloze.yaml'}: its data file {data} does not "
                                           "exist"), names
    data.write_text('{"document": 0, "context": "to be or not to ", "target": "be"}\n')
    for names, include in ways:
        assert select_tasks(names, include).tasks


def test_the_offline_command_keeps_the_pipeline_stages_where_the_world_fits_them_and_no_task_generates() -> None:
    """scoring_config: a TP=2 x PP=2 run scored by 4 or 8 ranks keeps its stages (the rest data-parallel); by 2 or
    6 ranks (not a multiple of 4), or with a generate_until task, every rank holds all layers of its TP shard; in
    one process the model is whole."""
    from scaletrain.config_loader import load_config
    from scaletrain.evaluation.downstream import scoring_config

    run = load_config(DEMO_CONFIG, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1",
                                    "tracking.wandb=disabled"])
    layouts = {(world, generating): (config.parallel.tensor, config.parallel.pipeline, config.parallel.data)
               for world, generating in [(1, False), (2, False), (4, False), (4, True), (6, False), (8, False)]
               for config in [scoring_config(run, world, generating)]}
    assert layouts == {(1, False): (1, 1, 1), (2, False): (2, 1, 1), (4, False): (2, 2, 1), (4, True): (2, 1, 2),
                       (6, False): (2, 1, 3), (8, False): (2, 2, 2)}
