"""A checkpoint resumes in any other parallel layout with its Adam state (checkpoint/layout_free.py).

Each case trains 20 steps straight in the source layout (a checkpoint at step 10), then a new run
directory resumes that step-10 checkpoint in the target layout; steps 11-20 must match the straight
run within 1e-4 in fp32 (relative; only the reduction order differs between layouts). With lr 3e-3,
Adam moments lost or misplaced change those losses by far more than that (1.6e-2 when a bf16 run's
moments were read as zeros, found while writing this). In bf16 the master weights and moments are
fp32 but every matmul rounds to 8 significant bits, and two layouts round different partial sums:
the tolerance is 2^-10 (about 1e-3), a quarter of bf16's unit roundoff 2^-8 at the loss; measured
differences were below 4e-5. The matrix: fp32 and bf16 x sources ZeRO-0, ZeRO-1, ZeRO-3, PP2 and
TP2, each into a different layout, plus the earlier TP2xDP2 ZeRO-2 -> PP2xDP2 case.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.harness import run_on_ranks
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    TrainedAhead,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

STEPS = 20
RESUME_STEP = 10
BF16_TOLERANCE = 2.0 ** -10

# name -> (processes, overrides); a name ending in "@bf16" is the same layout trained in bf16
LAYOUTS = {
    "tp1_zero0": (1, ["parallel.zero_stage=0"]),
    "tp2": (2, ["parallel.tensor=2"]),
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "dp1_zero0": (1, ["parallel.zero_stage=0"]),
    "dp2_zero3": (2, ["parallel.zero_stage=3"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "pp1": (1, []),
    "tp2_dp2_zero2": (4, ["parallel.tensor=2", "parallel.zero_stage=2"]),
    "pp2_dp2": (4, ["parallel.pipeline=2", "parallel.zero_stage=1"]),
}
# (source, target): every source kind in both precisions, each into another layout
CASES = [
    ("tp1_zero0", "tp2"), ("dp2_zero1", "dp1_zero0"), ("pp2", "pp1"), ("tp2_dp2_zero2", "pp2_dp2"),
    ("dp2_zero3", "tp2"), ("tp2", "dp2_zero3"),
    ("tp1_zero0@bf16", "dp2_zero3@bf16"), ("dp2_zero1@bf16", "pp2@bf16"), ("dp2_zero3@bf16", "tp2@bf16"),
    ("pp2@bf16", "dp2_zero1@bf16"), ("tp2@bf16", "tp1_zero0@bf16"),
]


def layout(name: str) -> tuple[int, list[str]]:
    base, _, precision = name.partition("@")
    processes, overrides = LAYOUTS[base]
    return processes, [*overrides, f"train.precision={precision or 'fp32'}"]


def train_args(data_dir: Path, run_dir: Path, name: str, *extra: str) -> list[str]:
    common = [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=0",
              f"checkpoint.every={RESUME_STEP}", "checkpoint.keep_last=2"]
    return [str(DEMO_CONFIG), *common, *layout(name)[1], *extra]


def checkpoint_of(straight: Path) -> Path:
    return straight / "checkpoints" / f"step_{RESUME_STEP:08d}"


@pytest.fixture(scope="module")
def straight_runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    """The uninterrupted source-layout runs, straight_runs(layout) -> its run directory, each trained once
    per module and shared by the tests."""
    root = tmp_path_factory.mktemp("straight")

    def train(key: tuple[str], run_dir: Path) -> Path:
        (name,) = key
        run_scaletrain("train", train_args(small_dataset, run_dir, name), LAYOUTS[name.partition("@")[0]][0])
        return run_dir

    runs = TrainedAhead(train, lambda key: root / key[0].replace("@", "_"))
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def resumed_runs(
    small_dataset: Path, straight_runs: TrainedAhead, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TrainedAhead]:
    """resumed_runs(source, target) -> (the run resumed in the target layout from the source's step-10
    checkpoint, the resume's stderr); the next case of CASES trains ahead."""

    def train(key: tuple[str, str], resumed: Path) -> tuple[Path, str]:
        source, target = key
        args = train_args(small_dataset, resumed, target, f"train.resume={checkpoint_of(straight_runs(source))}")
        return resumed, run_and_read_stderr(args, layout(target)[0])

    runs = TrainedAhead(train, lambda key: tmp_path_factory.mktemp("-to-".join(key).replace("@", "_")) / "resumed",
                        CASES)
    yield runs
    runs.close()


@pytest.fixture(scope="module", params=CASES, ids=[f"{source}-to-{target}" for source, target in CASES])
def resumed_case(request, straight_runs: TrainedAhead, resumed_runs: TrainedAhead) -> tuple[str, Path, Path, str]:
    """(the source layout, its straight run, the run resumed in the target layout, the resume's stderr)."""
    source, target = request.param
    return source, straight_runs(source), *resumed_runs(source, target)


def run_and_read_stderr(args: list[str], nproc: int, succeed: bool = True) -> str:
    """stderr of `scaletrain train` (where the resume and refusal lines go); it must succeed or fail."""
    result = subprocess.run([*launcher(nproc), "train", *args], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=600)
    assert (result.returncode == 0) == succeed, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stderr


@pytest.mark.slow
def test_resume_in_another_layout_continues_the_run(resumed_case: tuple[str, Path, Path, str]):
    source, straight, resumed, log = resumed_case
    tolerance = BF16_TOLERANCE if source.endswith("@bf16") else 1e-4
    assert "resharding checkpoint" in log
    reference, _ = read_metrics(straight)
    ours, _ = read_metrics(resumed)
    assert sorted(ours) == list(range(RESUME_STEP + 1, STEPS + 1))
    for step in range(RESUME_STEP + 1, STEPS + 1):
        relative = abs(ours[step]["loss"] - reference[step]["loss"]) / reference[step]["loss"]
        assert relative <= tolerance, f"step {step}: {ours[step]['loss']} resharded, {reference[step]['loss']} straight"
        assert ours[step]["lr"] == reference[step]["lr"]


def _full_states(rank: int, world_size: int, checkpoints: list[Path]) -> list[dict]:
    """Each checkpoint's full per-parameter state, merged by the index alone (no model built)."""
    from scaletrain.checkpoint.format import read_meta
    from scaletrain.checkpoint.layout_free import STATE_KEYS, _full_tensors, _PieceReader, read_index
    from scaletrain.checkpoint.safe_load import CheckedFiles

    states = []
    for path in checkpoints:
        index = read_index(path)
        reader = _PieceReader(path, CheckedFiles(path, read_meta(path).files))
        states.append({"step": index["adam_step"], "parameters": {
            name: _full_tensors(name, entry, reader, STATE_KEYS, path)
            for name, entry in index["parameters"].items()}})
    return states


@pytest.mark.slow
def test_adam_state_reads_the_same_from_any_layout(straight_runs: TrainedAhead):
    """The same 10 steps saved from one rank (ZeRO-0, torch's own state) and from TP2 x DP2 ZeRO-2 (flat
    partitions cut by tensor rank) hold the same per-parameter Adam state (up to the layouts' rounding)."""
    checkpoints = [checkpoint_of(straight_runs("tp1_zero0")), checkpoint_of(straight_runs("tp2_dp2_zero2"))]
    single, sharded = run_on_ranks(_full_states, 1, checkpoints)[0]
    assert single["step"] == sharded["step"] == RESUME_STEP
    assert single["parameters"].keys() == sharded["parameters"].keys()
    for name, state in single["parameters"].items():
        for key, tolerance in (("weight", 1e-2), ("exp_avg", 1e-3), ("exp_avg_sq", 1e-3)):
            ours, reference = sharded["parameters"][name][key], state[key]
            assert ours.shape == reference.shape, f"{name} {key}"
            scale = reference.abs().max()
            assert scale > 0, f"{name} {key} is all zeros: no optimizer state was read"
            assert (ours - reference).abs().max() <= tolerance * scale, f"{name} {key} differs between layouts"
