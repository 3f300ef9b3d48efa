"""On a CUDA GPU (`pytest -m gpu`; skipped without one, never needed by `make test`): every family trains in
bf16 with a falling loss, a checkpoint saved on the GPU resumes on the CPU and back, and greedy decoding
on the GPU gives the CPU's text. benchmarks/gpu_check.py runs these after its throughput figures.

The dataset is the tests' small one (tests/conftest.py), or the prepared copy that
SCALETRAIN_SMALL_DATASET names (a GPU node without internet cannot build the corpus).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.train.runs import REPO, launcher, read_metrics, scaletrain_environment, tiny_overrides

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# family -> (tiny config, overrides on top of tiny_overrides' 2 layers of hidden 64), as the layout tests train them
FAMILIES = {
    "gpt": ("gpt_tiny.yaml", []),
    "llama": ("llama_tiny.yaml", ["model.ffn_hidden_size=176"]),
    "mixtral": ("mixtral_tiny.yaml", ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=32"]),
    "bert": ("bert_tiny.yaml", []),
    "albert": ("albert_tiny.yaml", ["model.embedding_size=32", "model.seq_length=64", "model.ffn_hidden_size=128"]),
    "electra": ("electra_tiny.yaml", ["model.embedding_size=32", "model.generator_hidden_size=32",
                                      "model.generator_num_heads=2"]),
    "t5": ("t5_tiny.yaml", ["model.num_decoder_layers=2", "model.ffn_hidden_size=128"]),
    "bart": ("bart_tiny.yaml", ["model.num_decoder_layers=2", "model.ffn_hidden_size=128", "model.seq_length=64"]),
}
STEPS = 20


@pytest.fixture(scope="module")
def dataset(request: pytest.FixtureRequest) -> Path:
    prepared = os.environ.get("SCALETRAIN_SMALL_DATASET")
    return Path(prepared) if prepared else request.getfixturevalue("small_dataset")


def train_command(family: str, dataset: Path, run_dir: Path, *extra: str) -> list[str]:
    config, overrides = FAMILIES[family]
    return [*launcher(1, fresh=True), "train", str(REPO / "configs" / config), *tiny_overrides(dataset, run_dir),
            *overrides, "train.precision=bf16", "train.lr=3e-3", "train.eval_every=0", "checkpoint.every=10", *extra]


def run(command: list[str], cpu: bool = False) -> str:
    environment = {**scaletrain_environment(), **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def losses(run_dir: Path) -> list[float]:
    training, _ = read_metrics(run_dir)
    return [training[step]["loss"] for step in sorted(training)]


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """Every family trained STEPS bf16 steps on the GPU, all at once (tiny models leave the GPU mostly idle,
    and the node's cores run their loaders): family -> (run dir, exit code, output). The other tests go on
    from GPT's run instead of training their own (the check's five minutes)."""
    root = tmp_path_factory.mktemp("families")
    environment = scaletrain_environment()
    started = {family: subprocess.Popen(train_command(family, dataset, root / family, f"train.steps={STEPS}",
                                                      "train.log_every=1"),
                                        cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
               for family in FAMILIES}
    outputs = {family: process.communicate(timeout=600)[0] for family, process in started.items()}
    return {family: (root / family, started[family].returncode, outputs[family]) for family in FAMILIES}


def test_every_family_trains_20_bf16_steps_with_a_falling_loss(trained: dict[str, tuple[Path, int, str]]):
    failures = {}
    for family, (run_dir, returncode, output) in trained.items():
        if returncode != 0:
            failures[family] = output[-2000:]
            continue
        curve = losses(run_dir)
        if not (len(curve) == STEPS and sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 0.1):
            failures[family] = f"loss did not fall over {STEPS} steps: {curve}"
        if "cuda" not in output:
            failures[family] = f"did not say it trained on cuda:\n{output[-1500:]}"
    assert not failures, failures


def trained_gpt(trained: dict[str, tuple[Path, int, str]], tmp_path: Path) -> Path:
    """A copy of GPT's 20-step GPU run, for a test to go on from."""
    run_dir, returncode, output = trained["gpt"]
    assert returncode == 0, output[-2000:]
    return Path(shutil.copytree(run_dir, tmp_path / "gpt"))


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu_and_back(trained, dataset: Path, tmp_path: Path):
    run_dir = trained_gpt(trained, tmp_path)
    run(train_command("gpt", dataset, run_dir, f"train.steps={STEPS + 10}"), cpu=True)
    run(train_command("gpt", dataset, run_dir, f"train.steps={STEPS + 20}"))
    curve = losses(run_dir)
    assert len(curve) >= STEPS + 20 and all(loss == loss for loss in curve), curve
    assert sum(curve[-5:]) < sum(curve[:5]), curve


def test_greedy_decoding_on_the_gpu_equals_the_cpu(trained, tmp_path: Path):
    run_dir = trained_gpt(trained, tmp_path)
    generate = [*launcher(1, fresh=True), "generate", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "40",
                "--top-k", "1"]
    assert run(generate) == run(generate, cpu=True)
