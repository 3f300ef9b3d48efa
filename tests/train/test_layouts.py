"""Every layout trains the single-rank model and resumes exactly.

Each layout runs 20 steps straight, saving at step 10 (in the background, while it trains on), and a
second run in a new directory resumes from that checkpoint (`train.resume=PATH`) for the last 10. Its
steps 11-20 must reproduce the straight run's bit for bit (CPU, fp32), and the straight run must match
a single-rank reference (relative difference <= 1e-4 per step: only the reduction order differs).
Stopping early and resuming in the same directory (`train.exit_after`, `train.resume=auto`) is tested
in test_robustness.py and test_signals.py; here two processes per layout do what three did.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.train.runs import DEMO_CONFIG, TrainedAhead, read_metrics, run_scaletrain, tiny_overrides

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


def train_layout(data_dir: Path, root: Path, config: str, overrides: list[str],
                 layouts: dict[str, tuple[int, list[str]]], layout: str) -> LayoutRuns:
    """train_twice in `layout`: "single" (one rank) or a key of `layouts`."""
    nproc, layout_overrides = (1, []) if layout == "single" else layouts[layout]
    return train_twice(data_dir, root, nproc, [*overrides, *layout_overrides], config=config)


def cached_layout_runs(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, config: str, overrides: list[str], label: str,
    layouts: dict[str, tuple[int, list[str]]] = LAYOUTS, order: Sequence[str] = (),
) -> TrainedAhead:
    """One model's runs by layout name, runs(layout) ("single" for one rank, or a key of `layouts`), each
    trained twice (train_twice) when first asked for, or ahead in `order`, and kept: the single-rank
    reference serves every layout. Close it when the module ends."""
    return TrainedAhead(lambda key, root: train_layout(data_dir, root, config, overrides, layouts, key[0]),
                        lambda key: tmp_path_factory.mktemp(f"{label}_{key[0]}"), [(layout,) for layout in order])


def in_asking_order(cases: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each (model, layout) case, then its model's single-rank reference: the order a layout's test asks."""
    return list(dict.fromkeys(key for name, layout in cases for key in ((name, layout), (name, "single"))))


def cached_runs_by_model(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, models: dict[str, tuple[str, list[str]]],
    label_prefix: str = "", layouts: dict[str, tuple[int, list[str]]] = LAYOUTS,
    order: Sequence[tuple[str, str]] = (),
) -> TrainedAhead:
    """cached_layout_runs for several models by name (config, overrides): runs(name, layout)."""

    def train(key: tuple[str, str], root: Path) -> LayoutRuns:
        config, overrides = models[key[0]]
        return train_layout(data_dir, root, str(config), overrides, layouts, key[1])

    return TrainedAhead(train, lambda key: tmp_path_factory.mktemp(f"{label_prefix}{key[0]}_{key[1]}"), order)


@pytest.fixture(scope="module")
def gpt_layout_runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    runs = cached_layout_runs(small_dataset, tmp_path_factory, str(DEMO_CONFIG), [], "gpt",
                              order=["single", *sorted(LAYOUTS)])
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def reference_run(gpt_layout_runs: TrainedAhead) -> LayoutRuns:
    return gpt_layout_runs("single")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_run(request, gpt_layout_runs: TrainedAhead) -> LayoutRuns:
    return gpt_layout_runs(request.param)


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
    small_dataset: Path, tmp_path_factory: pytest.TempPathFactory, gpt_layout_runs: TrainedAhead
) -> dict[str, tuple[Path, Path]]:
    """Per family, 20 steps at TP=2 without and with sequence parallelism (same seed and data); GPT's are
    the straight runs of its layouts tp2 and tp2_sequence_parallel (a checkpoint at step 10 is all they add)."""
    pairs = {"gpt": (gpt_layout_runs("tp2").straight, gpt_layout_runs("tp2_sequence_parallel").straight)}
    for family, config in SEQUENCE_PARALLEL_FAMILIES.items():
        if family in pairs:
            continue
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
