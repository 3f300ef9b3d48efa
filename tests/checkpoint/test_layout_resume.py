"""A checkpoint resumes in another parallel layout with its Adam state (checkpoint/reshard.py).

Each case trains 20 steps straight in the source layout (a checkpoint at step 10), then a new run
directory resumes that step-10 checkpoint in the target layout; steps 11-20 must match the straight
run within 1e-4 (relative; only the reduction order differs between layouts). With lr 3e-3, Adam
moments lost or misplaced in the reshard change those losses by far more than that. The cases
cover ZeRO-0, -1 and -2 sources, ZeRO-0 and -1 targets, tensor and pipeline splits in both directions.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scaletrain.checkpoint.manager import LayoutMismatchError
from scaletrain.checkpoint.reshard import check_reshardable
from tests.distributed.harness import run_on_ranks
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

STEPS = 20
RESUME_STEP = 10

# name -> (processes, overrides)
LAYOUTS = {
    "tp1_zero0": (1, ["parallel.zero_stage=0"]),
    "tp2": (2, ["parallel.tensor=2"]),
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "dp1_zero0": (1, ["parallel.zero_stage=0"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "pp1": (1, []),
    "tp2_dp2_zero2": (4, ["parallel.tensor=2", "parallel.zero_stage=2"]),
    "pp2_dp2": (4, ["parallel.pipeline=2", "parallel.zero_stage=1"]),
}
# (source, target)
CASES = [("tp1_zero0", "tp2"), ("dp2_zero1", "dp1_zero0"), ("pp2", "pp1"), ("tp2_dp2_zero2", "pp2_dp2")]


def train_args(data_dir: Path, run_dir: Path, layout: str, *extra: str) -> list[str]:
    common = [*tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=0",
              f"checkpoint.every={RESUME_STEP}", "checkpoint.keep_last=2"]
    return [str(DEMO_CONFIG), *common, *LAYOUTS[layout][1], *extra]


class StraightRuns:
    """The uninterrupted source-layout runs, each trained once per module and shared by the tests."""

    def __init__(self, data_dir: Path, root: Path) -> None:
        self.data_dir, self.root, self.runs = data_dir, root, {}

    def __call__(self, layout: str) -> Path:
        if layout not in self.runs:
            run_dir = self.root / layout
            run_scaletrain("train", train_args(self.data_dir, run_dir, layout), LAYOUTS[layout][0])
            self.runs[layout] = run_dir
        return self.runs[layout]

    def checkpoint(self, layout: str) -> Path:
        return self(layout) / "checkpoints" / f"step_{RESUME_STEP:08d}"


@pytest.fixture(scope="module")
def straight_runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> StraightRuns:
    return StraightRuns(small_dataset, tmp_path_factory.mktemp("straight"))


@pytest.fixture(scope="module", params=CASES, ids=[f"{source}-to-{target}" for source, target in CASES])
def resumed_case(
    request, straight_runs: StraightRuns, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, str]:
    """(the straight source-layout run, the run resumed in the target layout, the resume's stderr)."""
    source, target = request.param
    resumed = tmp_path_factory.mktemp(f"{source}-to-{target}") / "resumed"
    args = train_args(straight_runs.data_dir, resumed, target, f"train.resume={straight_runs.checkpoint(source)}")
    return straight_runs(source), resumed, run_and_read_stderr(args, LAYOUTS[target][0])


def run_and_read_stderr(args: list[str], nproc: int, succeed: bool = True) -> str:
    """stderr of `scaletrain train` (where the resume and refusal lines go); it must succeed or fail."""
    result = subprocess.run([*launcher(nproc), "train", *args], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=600)
    assert (result.returncode == 0) == succeed, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stderr


@pytest.mark.slow
def test_resume_in_another_layout_continues_the_run(resumed_case: tuple[Path, Path, str]):
    straight, resumed, log = resumed_case
    assert "resharding checkpoint" in log
    reference, _ = read_metrics(straight)
    ours, _ = read_metrics(resumed)
    assert sorted(ours) == list(range(RESUME_STEP + 1, STEPS + 1))
    for step in range(RESUME_STEP + 1, STEPS + 1):
        relative = abs(ours[step]["loss"] - reference[step]["loss"]) / reference[step]["loss"]
        assert relative <= 1e-4, f"step {step}: {ours[step]['loss']} resharded, {reference[step]['loss']} straight"
        assert ours[step]["lr"] == reference[step]["lr"]


def _layout_free_states(rank: int, world_size: int, checkpoints: list[Path]) -> list[dict]:
    """In a world of one (the harness's process group): each checkpoint's layout-free state for the
    plain TP=1 model."""
    from scaletrain.checkpoint.manager import read_meta
    from scaletrain.checkpoint.reshard import read_layout_free_state
    from scaletrain.config_loader import load_config
    from scaletrain.generate import single_process_config
    from scaletrain.model import build_model
    from scaletrain.parallel.groups import init_distributed

    config = single_process_config(load_config(checkpoints[0] / "config.yaml"))
    init_distributed(config)
    wanted = dict(build_model(config).named_parameters())
    states = [read_layout_free_state(path, read_meta(path).layout, wanted) for path in checkpoints]
    return [{"step": state.optimizer_step, "parameters": state.parameters} for state in states]


@pytest.mark.slow
def test_adam_state_reads_the_same_from_any_layout(straight_runs: StraightRuns):
    """The same 10 steps saved as ZeRO-0 torch state (one rank) and as ZeRO-2 flat partitions cut by
    TP2 x DP2 read back as the same per-parameter Adam state (up to the layouts' rounding)."""
    checkpoints = [straight_runs.checkpoint("tp1_zero0"), straight_runs.checkpoint("tp2_dp2_zero2")]
    single, sharded = run_on_ranks(_layout_free_states, 1, checkpoints)[0]
    assert single["step"] == sharded["step"] == RESUME_STEP
    assert single["parameters"].keys() == sharded["parameters"].keys()
    for name, state in single["parameters"].items():
        for key, tolerance in (("weight", 1e-2), ("exp_avg", 1e-3), ("exp_avg_sq", 1e-3)):
            ours, reference = sharded["parameters"][name][key], state[key]
            assert ours.shape == reference.shape, f"{name} {key}"
            scale = reference.abs().max()
            assert scale > 0, f"{name} {key} is all zeros: no optimizer state was read"
            assert (ours - reference).abs().max() <= tolerance * scale, f"{name} {key} differs between layouts"


@pytest.mark.slow
def test_an_unsupported_layout_is_refused_naming_those_that_resume(straight_runs: StraightRuns, tmp_path: Path):
    args = train_args(straight_runs.data_dir, tmp_path / "zero3", "dp2_zero1", "parallel.zero_stage=3",
                      f"train.resume={straight_runs.checkpoint('tp1_zero0')}")
    log = run_and_read_stderr(args, 2, succeed=False)
    assert "from TP1 ZeRO-0 into DP2 ZeRO-3 is not supported" in log
    assert "parallel.zero_stage=0, 1 or 2" in log


@pytest.mark.parametrize(("source", "target", "hint"), [
    ({"tensor": 1, "pipeline": 1, "data": 2, "zero_stage": 3}, {"tensor": 2, "pipeline": 1, "data": 1, "zero_stage": 1},
     "resume it in its own layout (DP2 ZeRO-3"),
    ({"tensor": 1, "pipeline": 2, "data": 1, "zero_stage": 0}, {"tensor": 1, "pipeline": 1, "data": 2, "zero_stage": 1},
     "resume it in its own layout PP2 ZeRO-0"),
])
def test_unmapped_sources_are_refused(source: dict, target: dict, hint: str):
    with pytest.raises(LayoutMismatchError, match="is not supported") as refused:
        check_reshardable(Path("step_00000010"), source, target)
    assert hint in str(refused.value)


def test_mapped_layouts_pass_the_check():
    source = {"tensor": 2, "pipeline": 1, "data": 2, "zero_stage": 2}
    check_reshardable(Path("step_00000010"), source, {"tensor": 1, "pipeline": 2, "data": 2, "zero_stage": 0})
