"""`scaletrain eval`: a checkpoint's validation loss, in one process, equals the one its training run
logged at that step, whatever layout trained it; it names the checkpoint it read and how many of the split's
sequences and tokens it averaged over (a sample, or --samples all), and a training run
pruning that checkpoint meanwhile changes nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scaletrain import evaluate
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

STEPS = 4


def _train(data_dir: Path, run_dir: Path, nproc: int, *layout: str) -> dict[int, float]:
    """A tiny GPT run evaluated and checkpointed at its last step; its logged val_loss by step."""
    overrides = [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", f"train.eval_every={STEPS}",
                 f"checkpoint.every={STEPS}", *layout]
    run_scaletrain("train", [str(DEMO_CONFIG), *overrides], nproc)
    return read_metrics(run_dir)[1]


def _eval(run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(1), "eval", str(run_dir), *options], cwd=REPO, env=scaletrain_environment(),
                          capture_output=True, text=True, timeout=300)


def _printed(stdout: str) -> dict[str, float]:
    """The `name value` lines after the `step N (...)` line."""
    return {name: float(value) for name, value in (line.split() for line in stdout.splitlines()[1:])}


@pytest.fixture(scope="module")
def single_rank_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """A 4-step run on one rank (~20 s on 2 cores) and its logged val_loss by step; eval writes nothing to it."""
    run_dir = tmp_path_factory.mktemp("single_rank") / "run"
    return run_dir, _train(small_dataset, run_dir, 1)


@pytest.mark.slow
def test_eval_of_a_single_rank_run(single_rank_run: tuple[Path, dict[int, float]]) -> None:
    run_dir, logged = single_rank_run
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"

    result = _eval(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"using checkpoint {checkpoint} (step {STEPS})" in result.stderr
    printed = _printed(result.stdout)
    split = int(printed["val_split_sequences"])
    assert result.stdout.startswith(f"step {STEPS} ({checkpoint}): 16 of {split} validation sequences of 32 tokens "
                                    f"(sampled with train.eval_seed=0), 512 loss tokens of the split's {split * 32} "
                                    "tokens\n")
    assert printed["val_loss"] == pytest.approx(logged[STEPS], abs=1e-5)
    assert (printed["val_sequences"], printed["val_tokens"]) == (16, 16 * 32)

    fewer = _eval(run_dir, "--checkpoint", checkpoint.name, "--samples", "8")  # a name under RUN/checkpoints
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert fewer.stdout.startswith(f"step {STEPS} ({checkpoint}): 8 of {split} validation sequences")
    assert _printed(fewer.stdout)["val_loss"] != pytest.approx(logged[STEPS], abs=1e-5)

    whole = _eval(run_dir, "--samples", "all")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert f": {split} of {split} validation sequences of 32 tokens (the whole split), {split * 32} loss" \
        in whole.stdout
    wrong = _eval(run_dir, "--samples", "most")
    assert wrong.returncode == 2 and "--samples most: give a number of validation sequences" in wrong.stderr

    missing = _eval(run_dir, "--checkpoint", "step_00000099")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "scaletrain eval: error: --checkpoint step_00000099 is not a complete checkpoint" in missing.stderr


@pytest.mark.slow  # trains a 4-step run on 2 ranks (~30 s on 2 cores)
def test_eval_of_a_tensor_parallel_run_in_one_process(small_dataset: Path, tmp_path: Path) -> None:
    """TP=2 trained it; one unsplit model evaluates it: the same loss up to float summation order."""
    run_dir = tmp_path / "run"
    logged = _train(small_dataset, run_dir, 2, "parallel.tensor=2")
    result = _eval(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _printed(result.stdout)["val_loss"] == pytest.approx(logged[STEPS], abs=1e-5)


@pytest.mark.slow
def test_eval_reads_one_snapshot_of_a_checkpoint_pruned_while_it_evaluates(
    single_rank_run: tuple[Path, dict[int, float]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run beside a training run that prunes (checkpoint.keep_last), eval failed 3 times of 4: it read
    meta.json again after evaluating, from a checkpoint pruned meanwhile. Here the prune comes as the
    evaluation starts, in this process (eval is one process: no launcher needed)."""
    trained, logged = single_rank_run
    run_dir = Path(shutil.copytree(trained, tmp_path / "run"))
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"

    def pruned_meanwhile(*args, **kwargs):
        shutil.rmtree(checkpoint)
        return validation_metrics(*args, **kwargs)

    validation_metrics = evaluate.validation_metrics
    monkeypatch.setattr(evaluate, "validation_metrics", pruned_meanwhile)
    # a world of one (its store on any free port), its variables undone after the test
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)
    evaluation = evaluate.evaluate_checkpoint(run_dir)
    assert not checkpoint.exists()
    assert (evaluation.checkpoint, evaluation.step) == (checkpoint, STEPS)
    assert evaluation.metrics["val_loss"] == pytest.approx(logged[STEPS], abs=1e-5)
