"""train.compile (train/compile.py): compiled blocks train as the eager model does, at one rank and at TP=2,
and a checkpoint does not know whether its run compiled.

Compiling costs seconds per process on two cores, so the runs are tiny (tests/train/runs.py: 2 layers,
hidden 64), short, few, and shared by the module's tests. Inductor may reorder float operations, so
compiled losses are held to TOLERANCE of the eager ones (relative), where a layout is held to 1e-4 of one
rank (test_layouts.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from scaletrain.config_loader import config_from_dict
from tests.distributed.harness import run_on_ranks
from tests.train.runs import DEMO_CONFIG, read_metrics, run_scaletrain, tiny_overrides

STEPS, RESUME_AT = 4, 2
TOLERANCE = 1e-5
COMPILED = "train.compile=true"
# name -> (processes, overrides, the run whose checkpoint of step RESUME_AT it resumes from, if any)
RUNS: dict[str, tuple[int, list[str], str | None]] = {
    "eager": (1, [], None),
    "compiled": (1, [COMPILED], None),
    "resumed_eager": (1, [], "compiled"),
    "resumed_compiled": (1, [COMPILED], "compiled"),
    "tp2_eager": (2, ["parallel.tensor=2", "train.eval_every=0"], None),
    "tp2_compiled": (2, ["parallel.tensor=2", "train.eval_every=0", COMPILED], None),
}


@pytest.fixture(scope="module")
def runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A run's directory by name, trained when first asked for (a resumed run trains its source first)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            nproc, overrides, source = RUNS[name]
            run_dir = tmp_path_factory.mktemp(name) / "run"
            resume = [f"train.resume={get(source) / 'checkpoints' / f'step_{RESUME_AT:08d}'}"] if source else []
            run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), f"train.steps={STEPS}",
                                     f"train.eval_every={STEPS}", f"checkpoint.every={RESUME_AT}", *overrides, *resume],
                           nproc)
            done[name] = run_dir
        return done[name]

    return get


def assert_close_losses(ours: Path, reference: Path, steps: range) -> None:
    """Every training loss of `steps` and every validation loss both logged within TOLERANCE (relative)."""
    (training, validation), (reference_training, reference_validation) = read_metrics(ours), read_metrics(reference)
    for step in steps:
        expected = reference_training[step]["loss"]
        assert abs(training[step]["loss"] - expected) <= TOLERANCE * expected, (
            f"step {step}: {training[step]['loss']} vs {expected}")
    for step in validation.keys() & reference_validation.keys():
        assert abs(validation[step] - reference_validation[step]) <= TOLERANCE * reference_validation[step]


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_model_at_one_rank(runs):
    assert_close_losses(runs("compiled"), runs("eager"), range(1, STEPS + 1))
    _, validation = read_metrics(runs("compiled"))
    assert sorted(validation) == [0, STEPS]  # the compiled blocks evaluated too


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_model_at_tp2(runs):
    # between megatron's collectives: the blocks compile in pieces (train/compile.py)
    assert_close_losses(runs("tp2_compiled"), runs("tp2_eager"), range(1, STEPS + 1))


@pytest.mark.slow
def test_a_compiled_checkpoint_resumes_eager_as_it_resumes_compiled(runs):
    after = range(RESUME_AT + 1, STEPS + 1)
    resumed_compiled, _ = read_metrics(runs("resumed_compiled"))
    straight, _ = read_metrics(runs("compiled"))
    assert sorted(resumed_compiled) == list(after)
    # compiled, the resume is as exact as eager (test_layouts.py)
    assert [resumed_compiled[step]["loss"] for step in after] == [straight[step]["loss"] for step in after]
    assert_close_losses(runs("resumed_eager"), runs("resumed_compiled"), after)


@pytest.mark.slow
def test_a_compiled_run_names_its_checkpointed_tensors_as_an_eager_run(runs):
    def parameters(run: str) -> dict[str, object]:
        index = runs(run) / "checkpoints" / f"step_{RESUME_AT:08d}" / "model" / "index.json"
        return {name: entry["shape"] for name, entry in json.loads(index.read_text())["parameters"].items()}

    assert parameters("compiled") == parameters("eager")


def _compiled_and_eager_gradients(rank: int, world_size: int) -> dict:
    """Loss and gradients of a tiny GPT under full recomputation, eager and with compiled blocks; what dynamo made."""
    from megatron.core import parallel_state

    from scaletrain.families import build_model
    from scaletrain.train.compile import compile_blocks

    parallel_state.initialize_model_parallel()
    config = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16},
                               "data": {"vocab_size": 400, "num_sentinels": 4},
                               "train": {"seed": 3, "activation_checkpoint": "full", "compile": True}})
    tokens = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for compiled in (False, True):
        model = build_model(config)
        if compiled:
            results["whole_graphs"] = compile_blocks(model, config)
        loss = model(tokens, torch.roll(tokens, -1, dims=1))
        loss.backward()
        results[compiled] = (loss.detach(), {name: p.grad for name, p in model.named_parameters()},
                             list(model.state_dict()))
    results["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return results


@pytest.mark.slow  # compiling takes seconds
def test_blocks_compile_in_place_into_one_whole_graph_and_recompute_fully():
    results = run_on_ranks(_compiled_and_eager_gradients, 1)[0]
    (eager_loss, eager_gradients, eager_names), (loss, gradients, names) = results[False], results[True]
    assert results["whole_graphs"] and results["graphs"] == 1  # the two blocks share one graph
    assert names == eager_names  # compiled in place: no `_orig_mod.` in the state dict
    torch.testing.assert_close(loss, eager_loss, rtol=TOLERANCE, atol=0)
    for name, gradient in eager_gradients.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
