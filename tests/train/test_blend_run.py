"""A blended run through the CLI: prepared with one reused tokenizer, checked, trained on two ranks,
stopped mid-run and resumed exactly (reading one dataset over HTTP the second time), with a
validation loss per dataset and their weighted mean."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import SMALL_DATASET_SETTINGS
from tests.data.test_storage import serve
from tests.train.runs import DEMO_CONFIG, run_scaletrain, tiny_overrides

WEIGHTS = {"shakespeare": 0.25, "tragedies": 0.75}
STEPS = 6


@pytest.fixture(scope="module")
def tragedies_dataset(shakespeare_corpus: list[Path], small_dataset: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other works, tokenized with small_dataset's tokenizer (data.tokenizer) through the CLI."""
    works = ("othello_gut.txt", "king_lear_gut.txt", "much_ado_about_nothing_gut.txt")
    root = tmp_path_factory.mktemp("tragedies")
    raw = root / "raw"
    raw.mkdir()
    for path in shakespeare_corpus:
        if path.name in works:
            (raw / path.name).write_bytes(path.read_bytes())
    data_dir = root / "data"
    run_scaletrain("prepare", [
        str(DEMO_CONFIG), f"data.dir={data_dir}", f"data.raw=[{raw}]",
        f"data.tokenizer={small_dataset}/tokenizer.model",
        f"data.vocab_size={SMALL_DATASET_SETTINGS['vocab_size']}",
        f"data.num_sentinels={SMALL_DATASET_SETTINGS['num_sentinels']}", "data.val_fraction=0.3",
    ])
    return data_dir


def blend_overrides(small_dataset: Path, tragedies: Path | str, run_dir: Path, *extra: str) -> list[str]:
    blend = (f"data.blend=[{{dir: {small_dataset}, weight: 1, name: shakespeare}}, "
             f"{{dir: {tragedies}, weight: 3, name: tragedies}}]")
    return [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), blend, f"train.steps={STEPS}",
            "train.eval_every=3", "checkpoint.every=3", *extra]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_blended_run_resumes_exactly_and_reports_each_dataset(small_dataset: Path, tragedies_dataset: Path,
                                                                tmp_path: Path):
    check = run_scaletrain("check", [*blend_overrides(small_dataset, tragedies_dataset, tmp_path / "straight"),
                                     "--world-size", "2"])
    assert f"blend 0.250 {small_dataset} + 0.750 {tragedies_dataset}" in check

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_scaletrain("train", blend_overrides(small_dataset, tragedies_dataset, straight), nproc=2)
    with serve(tragedies_dataset) as (url, requests):
        remote = [f"data.cache_dir={tmp_path / 'cache'}"]
        run_scaletrain("train", blend_overrides(small_dataset, url, interrupted, "train.exit_after=4", *remote),
                       nproc=2, stopped_early=True)
        run_scaletrain("train", blend_overrides(small_dataset, url, interrupted, *remote), nproc=2)
    assert requests["manifest.json"] > 0 and any(name.startswith("train-") for name in requests)

    def by_step(run_dir: Path) -> tuple[dict[int, float], dict[int, dict]]:
        losses, evaluations = {}, {}
        for record in records(run_dir):
            if "val_loss" in record:
                evaluations[record["step"]] = record
            else:
                losses[record["step"]] = record["loss"]
        return losses, evaluations

    straight_losses, straight_evals = by_step(straight)
    resumed_losses, resumed_evals = by_step(interrupted)
    assert sorted(straight_losses) == list(range(1, STEPS + 1))
    assert resumed_losses == straight_losses  # bit for bit, through a stop at step 4 (mid-blend, mid-epoch)
    assert resumed_evals[STEPS] == straight_evals[STEPS]
    final = straight_evals[STEPS]
    assert final["val_loss/shakespeare"] != final["val_loss/tragedies"]
    expected = sum(weight * final[f"val_loss/{name}"] for name, weight in WEIGHTS.items())
    assert math.isclose(final["val_loss"], expected, rel_tol=1e-9)
