"""Output a user can act on: no library notices before a run's first step, DeepSpeed's op built once per venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.notices import OP_BUILT, PIPELINE_LAYOUT, without_stdout_lines
from scaletrain.train.jit_ops import environment_build_root
from tests.train.runs import DEMO_CONFIG, REPO, launcher, scaletrain_environment, tiny_overrides

# What a 2-rank run printed before its first step (issue 21): 24 lines, 28 with torchrun's banner.
KNOWN_NOISE = (
    "Transformer Engine and Apex are not installed",  # megatron-core, 4 warnings per rank
    "Setting accelerator to CPU",  # DeepSpeed, per rank
    "built successfully",  # DeepSpeed's CPU op, per rank
    "CUDA_DEVICE_MAX_CONNECTIONS",  # megatron-core's GPU advice
    "is deprecated",  # torch, on the collectives DeepSpeed's ZeRO calls
    "Setting OMP_NUM_THREADS environment variable",  # torchrun's banner
    "Warning:",  # any other library warning (UserWarning: ..., FutureWarning: ...)
)
OWN_LINES = ("train: ", "compiling DeepSpeed's CPU op ", "waiting for ", "removed ")  # scaletrain's own


@pytest.mark.slow
def test_a_two_rank_run_prints_no_library_notice_before_its_first_step(small_dataset: Path, tmp_path: Path):
    """And it builds DeepSpeed's CPU op under this venv's own root, saying so once, when it is not there yet."""
    library = environment_build_root(sys.prefix) / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built_before = library.exists()
    environment = scaletrain_environment()
    environment.pop("TORCH_EXTENSIONS_DIR", None)
    result = subprocess.run(
        [*launcher(2, fresh=True), "train", str(DEMO_CONFIG), *tiny_overrides(small_dataset, tmp_path / "run"),
         "train.steps=2", "train.warmup_steps=1"],
        cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout[-3000:]
    first_step = next(index for index, line in enumerate(lines) if line.startswith("train: step "))
    notices = [line for line in lines[:first_step] if line.strip() and not line.startswith(OWN_LINES)]
    print(f"{len(notices)} lines of library notices before the first step")
    assert not notices, "\n".join(notices)
    assert not [line for line in lines if any(text in line for text in KNOWN_NOISE)], result.stdout[-3000:]
    assert library.exists()
    assert sum(line.startswith("compiling DeepSpeed's CPU op") for line in lines) == (0 if built_before else 1)


def test_only_the_library_lines_it_names_are_left_out_of_stdout(capsys: pytest.CaptureFixture):
    with without_stdout_lines(OP_BUILT):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("step 1: the library's own line")
        print("an unfinished line", end="")
    with without_stdout_lines(PIPELINE_LAYOUT):  # as DeepSpeed 0.19's PipelineModule prints it, on rank 0
        print("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None\nUsing topology: {ProcessCoord(pipe=0): 0}")
        print("stage=0 layers=2\n     0: PipelineUnit\n     1: PipelineBlock\n  loss: <lambda>")
    assert capsys.readouterr().out == "step 1: the library's own line\nan unfinished line"
