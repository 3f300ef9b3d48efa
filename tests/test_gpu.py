"""On a CUDA GPU (`pytest -m gpu`; skipped without one, never needed by `make test`): every family trains in
bf16 with a falling loss, a checkpoint saved on the GPU resumes on the CPU and back, and greedy decoding
on the GPU gives the CPU's text. benchmarks/gpu_check.py runs these after its throughput figures.

The dataset is the tests' small one (tests/conftest.py), or the prepared copy that
SCALETRAIN_SMALL_DATASET names (a GPU node without internet cannot build the corpus).
"""

from __future__ import annotations

import os
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


def test_every_family_trains_20_bf16_steps_with_a_falling_loss(dataset: Path, tmp_path: Path):
    """All families at once: tiny models leave the GPU mostly idle, and the 16-core node runs their loaders."""
    environment = scaletrain_environment()
    started = {family: subprocess.Popen(train_command(family, dataset, tmp_path / family, f"train.steps={STEPS}",
                                                      "train.log_every=1"),
                                        cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
               for family in FAMILIES}
    failures = {}
    for family, process in started.items():
        output, _ = process.communicate(timeout=600)
        if process.returncode != 0:
            failures[family] = output[-2000:]
            continue
        curve = losses(tmp_path / family)
        if not (len(curve) == STEPS and sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 0.1):
            failures[family] = f"loss did not fall over {STEPS} steps: {curve}"
        if "cuda" not in output:
            failures[family] = f"did not say it trained on cuda:\n{output[-1500:]}"
    assert not failures, failures


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu_and_back(dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "moved"
    run(train_command("gpt", dataset, run_dir, "train.steps=10"))
    run(train_command("gpt", dataset, run_dir, "train.steps=20"), cpu=True)
    run(train_command("gpt", dataset, run_dir, "train.steps=30"))
    curve = losses(run_dir)
    assert len(curve) >= 30 and all(loss == loss for loss in curve), curve
    assert sum(curve[-5:]) < sum(curve[:5]), curve
    assert (run_dir / "checkpoints").exists() or any(run_dir.glob("**/meta.json"))


def test_greedy_decoding_on_the_gpu_equals_the_cpu(dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "decoded"
    run(train_command("gpt", dataset, run_dir, "train.steps=20"))
    generate = [*launcher(1, fresh=True), "generate", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "40",
                "--top-k", "1"]
    assert run(generate) == run(generate, cpu=True)
