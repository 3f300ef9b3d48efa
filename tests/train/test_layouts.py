"""Every layout trains the single-rank model and resumes exactly.

Each layout runs 20 steps straight, saving at step 10 (in the background, while it trains on), and a
second run in a new directory resumes from that checkpoint (`train.resume=PATH`) for the last 10. Its
steps 11-20 must reproduce the straight run's bit for bit (CPU, fp32), and the straight run must match
a single-rank reference (relative difference <= 1e-4 per step: only the reduction order differs).
Stopping early and resuming in the same directory (`train.exit_after`, `train.resume=auto`) is tested
in test_robustness.py and test_signals.py; here two processes per layout do what three did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.train.runs import DEMO_CONFIG, read_metrics, run_scaletrain, tiny_overrides

STEPS = 20
RESUME_AT = 10  # the straight run's checkpoint the second run resumes from

# name -> (processes, overrides)
LAYOUTS = {
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "tp2": (2, ["parallel.tensor=2"]),
    "dp2_zero2": (2, ["parallel.zero_stage=2"]),
    "dp2_zero3": (2, ["parallel.zero_stage=3"]),
    "pp2": (2, ["parallel.pipeline=2"]),
    "tp2_pp2": (4, ["parallel.tensor=2", "parallel.pipeline=2"]),
    "tp2_dp2_zero1": (4, ["parallel.tensor=2", "parallel.zero_stage=1"]),
    "pp2_dp2_zero1": (4, ["parallel.pipeline=2", "parallel.zero_stage=1"]),
    "pp2_recompute": (2, ["parallel.pipeline=2", "train.activation_checkpoint_interval=1"]),
    "tp2_recompute": (2, ["parallel.tensor=2", "train.activation_checkpoint_interval=1"]),
    "pp2_selective": (2, ["parallel.pipeline=2", "train.activation_checkpoint=selective"]),
    "tp2_sequence_parallel": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
}
# layouts of MoE models only (tests/train/test_moe_layouts.py): experts split over data-parallel ranks,
# with ZeRO-0 (our clipping norm), ZeRO-1 beside TP and ZeRO-2 with two ranks per expert
EXPERT_LAYOUTS = {
    "ep2_zero0": (2, ["parallel.expert=2", "parallel.zero_stage=0"]),
    "ep2_tp2": (4, ["parallel.expert=2", "parallel.tensor=2"]),
    "ep2_dp2_zero2": (4, ["parallel.expert=2", "parallel.zero_stage=2"]),
    "ep2_pp2": (4, ["parallel.expert=2", "parallel.pipeline=2"]),
}


@dataclass(frozen=True)
class LayoutRuns:
    straight: Path
    resumed: Path


def train_twice(
    data_dir: Path, root: Path, nproc: int, overrides: list[str], config: str = str(DEMO_CONFIG)
) -> LayoutRuns:
    straight, resumed = root / "straight", root / "resumed"
    common = [f"train.steps={STEPS}", "train.eval_every=10", *overrides]
    run_scaletrain("train", [config, *tiny_overrides(data_dir, straight), *common, f"checkpoint.every={RESUME_AT}"],
                   nproc)
    checkpoint = straight / "checkpoints" / f"step_{RESUME_AT:08d}"
    run_scaletrain("train", [config, *tiny_overrides(data_dir, resumed), *common, f"train.resume={checkpoint}"], nproc)
    return LayoutRuns(straight, resumed)


def cached_layout_runs(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, config: str, overrides: list[str], label: str,
    layouts: dict[str, tuple[int, list[str]]] = LAYOUTS,
) -> Callable[[str], LayoutRuns]:
    """One model's runs by layout name ("single" for one rank, or a key of `layouts`), each layout trained
    twice (train_twice) when first asked for and kept: the single-rank reference serves every layout."""
    cache: dict[str, LayoutRuns] = {}

    def get(layout: str) -> LayoutRuns:
        if layout not in cache:
            nproc, layout_overrides = (1, []) if layout == "single" else layouts[layout]
            cache[layout] = train_twice(data_dir, tmp_path_factory.mktemp(f"{label}_{layout}"), nproc,
                                        [*overrides, *layout_overrides], config=config)
        return cache[layout]

    return get


def cached_runs_by_model(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, models: dict[str, tuple[str, list[str]]],
    label_prefix: str = "", layouts: dict[str, tuple[int, list[str]]] = LAYOUTS,
) -> Callable[[str, str], LayoutRuns]:
    """cached_layout_runs for several models by name (config, overrides): runs(name, layout)."""
    by_name = {name: cached_layout_runs(data_dir, tmp_path_factory, str(config), overrides, f"{label_prefix}{name}",
                                        layouts)
               for name, (config, overrides) in models.items()}
    return lambda name, layout: by_name[name](layout)


@pytest.fixture(scope="module")
def reference_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    return train_twice(small_dataset, tmp_path_factory.mktemp("single_rank"), 1, [])


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_run(request, small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    nproc, overrides = LAYOUTS[request.param]
    return train_twice(small_dataset, tmp_path_factory.mktemp(request.param), nproc, overrides)


def assert_resume_is_exact(runs: LayoutRuns) -> None:
    straight, straight_val = read_metrics(runs.straight)
    resumed, resumed_val = read_metrics(runs.resumed)
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    for step in range(RESUME_AT + 1, STEPS + 1):
        assert resumed[step]["loss"] == straight[step]["loss"], f"step {step} loss differs after resume"
        assert resumed[step]["lr"] == straight[step]["lr"]
    assert resumed_val and resumed_val == {step: straight_val[step] for step in resumed_val}


@pytest.mark.slow
def test_single_rank_resume_is_bit_identical(reference_run: LayoutRuns):
    assert_resume_is_exact(reference_run)


@pytest.mark.slow
def test_layout_resume_is_bit_identical(layout_run: LayoutRuns):
    assert_resume_is_exact(layout_run)


def assert_matches_single_rank(runs: LayoutRuns, reference_runs: LayoutRuns) -> None:
    """Every step's loss and every validation loss within 1e-4 (relative) of the single-rank run."""
    reference, reference_val = read_metrics(reference_runs.straight)
    ours, ours_val = read_metrics(runs.straight)
    for step in range(1, STEPS + 1):
        relative = abs(ours[step]["loss"] - reference[step]["loss"]) / reference[step]["loss"]
        assert relative <= 1e-4, f"step {step}: {ours[step]['loss']} vs single rank {reference[step]['loss']}"
    for step, value in reference_val.items():
        assert abs(ours_val[step] - value) / value <= 1e-4


@pytest.mark.slow
def test_layout_matches_single_rank(layout_run: LayoutRuns, reference_run: LayoutRuns):
    assert_matches_single_rank(layout_run, reference_run)
    reference, _ = read_metrics(reference_run.straight)
    assert reference[STEPS]["loss"] < reference[1]["loss"] - 0.5, "the reference run did not learn"


SEQUENCE_PARALLEL_FAMILIES = {
    "gpt": str(DEMO_CONFIG),
    "llama": str(DEMO_CONFIG.parent / "llama_tiny.yaml"),
}


@pytest.fixture(scope="module")
def tensor_parallel_pairs(
    small_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """Per family, 20 steps at TP=2 without and with sequence parallelism (same seed and data)."""
    pairs = {}
    for family, config in SEQUENCE_PARALLEL_FAMILIES.items():
        runs = []
        for sequence_parallel in ("false", "true"):
            run_dir = tmp_path_factory.mktemp(f"{family}_sp_{sequence_parallel}")
            overrides = [*tiny_overrides(small_dataset, run_dir), f"train.steps={STEPS}", "train.eval_every=10",
                         "parallel.tensor=2", f"parallel.sequence_parallel={sequence_parallel}"]
            if family == "llama":
                overrides += ["model.num_kv_heads=2", "model.ffn_hidden_size=176"]
            run_scaletrain("train", [config, *overrides], 2)
            runs.append(run_dir)
        pairs[family] = (runs[0], runs[1])
    return pairs


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SEQUENCE_PARALLEL_FAMILIES))
def test_sequence_parallel_matches_tensor_parallel(tensor_parallel_pairs, family: str):
    """Korthikanti et al. 2022's sequence parallelism changes where norms run and which collectives
    move activations, not the math: every loss within 1e-5 of plain TP=2 (Llama with grouped-query
    attention, GPT with its tied output layer)."""
    plain, sequence_parallel = (read_metrics(run)[0] for run in tensor_parallel_pairs[family])
    assert sorted(sequence_parallel) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        relative = abs(sequence_parallel[step]["loss"] - plain[step]["loss"]) / abs(plain[step]["loss"])
        assert relative <= 1e-5, f"{family} step {step}: {sequence_parallel[step]['loss']} vs {plain[step]['loss']}"
