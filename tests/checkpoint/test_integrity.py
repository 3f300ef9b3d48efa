"""A checkpoint whose contents changed since its save is refused, and resume falls back to the one
before (checkpoint/integrity.py): a NaN written over the embedding at the same size, one flipped bit
in a file that one rank of two reads (caught by the CRC-32 alone; both ranks skip it), a NaN with
meta.json's CRC rewritten to match (caught by the finiteness check alone); generate likewise. A
meta.json changed in place (its step, its consumed_samples) is refused by its own CRC-32 (issue 37).

One straight run per layout trains 12 steps (checkpoints at 4, 8, 12); each case copies it, drops
step 12, damages step 8 and resumes: the run must take step 4 and train steps 5-12 exactly as the
straight run did.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import first_loadable, read_meta
from scaletrain.checkpoint.integrity import (
    META_CHECKSUM,
    FileRecord,
    check_finite,
    file_checksum,
    save_with_checksum,
    seal_meta,
)
from scaletrain.checkpoint.safe_load import CheckedFiles, load_tensors
from scaletrain.cli import main
from tests.train.runs import (
    DEMO_CONFIG,
    REPO,
    launcher,
    read_metrics,
    run_scaletrain,
    scaletrain_environment,
    tiny_overrides,
)

STEPS, EVERY, DAMAGED, FALLBACK = 12, 4, 8, 4
MODEL_STATES = "model/rank_00000.pt"  # rank 0's share of the layout-free state (checkpoint/layout_free.py)
EMBEDDING = "embedding.word.weight"


def overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [str(DEMO_CONFIG), *tiny_overrides(data_dir, run_dir), f"train.steps={STEPS}", "train.eval_every=0",
            f"checkpoint.every={EVERY}", "checkpoint.keep_last=3", *extra]


@pytest.fixture(scope="module")
def straight_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_scaletrain("train", overrides(small_dataset, run_dir, "parallel.zero_stage=0"))
    return run_dir


class TwoRankCase(NamedTuple):
    overrides: list[str]
    file: str  # one that a single rank reads
    rank: int  # which; rank 0 words the warning, naming the mismatch only when it is its own


TWO_RANK_CASES = {
    "zero1_dp2": TwoRankCase(["parallel.zero_stage=1"], "rng/rank_00000.pt", 0),
    "pipeline2": TwoRankCase(["parallel.pipeline=2"], "model/rank_00001.pt", 1),
}


@pytest.fixture(scope="module", params=list(TWO_RANK_CASES))
def straight_run_two_ranks(
    request: pytest.FixtureRequest, small_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    run_dir = tmp_path_factory.mktemp(f"straight_{request.param}") / "run"
    run_scaletrain("train", overrides(small_dataset, run_dir, *TWO_RANK_CASES[request.param].overrides), nproc=2)
    return request.param, run_dir


def interrupted_copy(straight: Path, run_dir: Path) -> Path:
    """The straight run as if it had stopped at step DAMAGED: its newer checkpoint gone. Returns the
    step-DAMAGED checkpoint, for the test to damage."""
    shutil.copytree(straight, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    (run_dir / "checkpoints" / "latest").write_text(f"step_{DAMAGED:08d}")
    return run_dir / "checkpoints" / f"step_{DAMAGED:08d}"


def resume(data_dir: Path, run_dir: Path, nproc: int = 1, *extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run([*launcher(nproc), "train", *overrides(data_dir, run_dir, *extra)], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def assert_resumed_exactly(result: subprocess.CompletedProcess, run_dir: Path, straight: Path, step: int) -> None:
    """The run resumed at `step` and trained the remaining steps with the straight run's losses."""
    assert f"resuming at step {step} from {run_dir / 'checkpoints' / f'step_{step:08d}'}" in result.stderr
    training, _ = read_metrics(run_dir)
    reference, _ = read_metrics(straight)
    assert sorted(training) == list(range(1, STEPS + 1))
    losses = [training[s]["loss"] for s in range(step + 1, STEPS + 1)]
    assert all(loss is not None and torch.isfinite(torch.tensor(loss)) for loss in losses)
    assert losses == [reference[s]["loss"] for s in range(step + 1, STEPS + 1)]


def overwrite_tensor_bytes(file: Path, tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Write `new` over the start of `tensor`'s data inside the torch zip `file`, in place (same
    size). torch stores each storage uncompressed, so its bytes appear verbatim in the file."""
    content = bytearray(file.read_bytes())
    data = tensor.contiguous().numpy().tobytes()
    offset = content.find(data)
    assert offset >= 0 and content.find(data, offset + 1) < 0, "the tensor's bytes are not unique in the file"
    patch = new.numpy().tobytes()
    content[offset:offset + len(patch)] = patch
    size = file.stat().st_size
    file.write_bytes(bytes(content))
    assert file.stat().st_size == size


def rewrite_checksum(checkpoint: Path, name: str) -> None:
    """meta.json made to vouch for the damaged file, and resealed, as someone who knew the format would."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name]["crc32"] = file_checksum(checkpoint / name)
    (checkpoint / "meta.json").write_text(json.dumps(seal_meta(meta)))


def piece_tensor(rank_file: Path, name: str, key: str = "weight") -> torch.Tensor:
    """The fp32 master weight (or an Adam moment) of parameter `name` in one rank's state file."""
    return next(piece["tensors"][key] for piece in load_tensors(rank_file)["pieces"] if piece["name"] == name)


NAN8 = torch.full((8,), float("nan"))


@pytest.mark.slow
def test_nan_over_the_embedding_is_caught_by_its_checksum(small_dataset: Path, straight_run: Path, tmp_path: Path):
    """The probe of issue 20: eight NaN floats over the embedding in the newest model-state file."""
    run_dir = tmp_path / "run"
    checkpoint = interrupted_copy(straight_run, run_dir)
    file = checkpoint / MODEL_STATES
    overwrite_tensor_bytes(file, piece_tensor(file, EMBEDDING), NAN8)
    result = resume(small_dataset, run_dir, 1, "parallel.zero_stage=0")
    assert f"warning: skipping checkpoint {checkpoint}: checkpoint {checkpoint}: {MODEL_STATES} has CRC-32" \
        in result.stderr
    assert "its bytes changed since the save" in result.stderr
    assert_resumed_exactly(result, run_dir, straight_run, FALLBACK)


@pytest.mark.slow
def test_nan_with_a_matching_checksum_is_caught_as_non_finite(
    small_dataset: Path, straight_run: Path, tmp_path: Path
):
    """NaN in a weight and in an Adam moment, meta.json's CRC rewritten: only the finiteness check sees it."""
    run_dir = tmp_path / "run"
    checkpoint = interrupted_copy(straight_run, run_dir)
    file = checkpoint / MODEL_STATES
    overwrite_tensor_bytes(file, piece_tensor(file, EMBEDDING), NAN8)
    overwrite_tensor_bytes(file, piece_tensor(file, EMBEDDING, "exp_avg_sq"), torch.full((3,), float("inf")))
    rewrite_checksum(checkpoint, MODEL_STATES)
    result = resume(small_dataset, run_dir, 1, "parallel.zero_stage=0")
    assert f"warning: skipping checkpoint {checkpoint}: checkpoint {checkpoint} holds non-finite values: " \
           f"weight {EMBEDDING} (8 of " in result.stderr
    assert f"Adam exp_avg_sq of {EMBEDDING} (3 of " in result.stderr
    assert_resumed_exactly(result, run_dir, straight_run, FALLBACK)


@pytest.mark.slow
def test_a_flipped_bit_on_one_rank_of_two_skips_the_checkpoint_on_both(
    small_dataset: Path, straight_run_two_ranks: tuple[str, Path], tmp_path: Path
):
    """One bit flipped in a file that one rank alone reads, the value still finite (only the CRC
    catches it): rank 0's RNG state under ZeRO-1 (both ranks read both state files there), or
    pipeline stage 1's state file (the last block's weights; the tied embedding is stage 0's). Both
    ranks take step 4, and the warning gives the failing rank's reason."""
    layout, straight = straight_run_two_ranks
    case = TWO_RANK_CASES[layout]
    run_dir = tmp_path / "run"
    checkpoint = interrupted_copy(straight, run_dir)
    file = checkpoint / case.file
    if layout == "pipeline2":
        tensor = piece_tensor(file, "final_norm.weight", "exp_avg")
        flipped = (tensor[:1].detach().clone().view(torch.int32) ^ 1).view(torch.float32)  # lowest mantissa bit
    else:
        tensor = load_tensors(file)["torch"][-64:]  # the end of the CPU generator's state, bytes
        flipped = tensor.clone()
        flipped[-1] ^= 1
    overwrite_tensor_bytes(file, tensor, flipped)
    result = resume(small_dataset, run_dir, 2, *case.overrides)
    # rank 0 prints the reason of the rank that failed, which may be rank 1 alone
    assert f"warning: skipping checkpoint {checkpoint}: checkpoint {checkpoint}: {case.file} has CRC-32" \
        in result.stderr
    assert f"(rank {case.rank}); trying" in result.stderr
    assert_resumed_exactly(result, run_dir, straight, FALLBACK)


@pytest.mark.slow
def test_a_checkpoint_with_sizes_only_in_meta_json_still_resumes(
    small_dataset: Path, straight_run: Path, tmp_path: Path
):
    """meta.json as checkpoints before issue 20 wrote it ({path: size}, not sealed): resumed, size-checked only."""
    run_dir = tmp_path / "run"
    checkpoint = interrupted_copy(straight_run, run_dir)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"] = {name: record["bytes"] for name, record in meta["files"].items()}
    del meta[META_CHECKSUM]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert read_meta(checkpoint).files[MODEL_STATES] == FileRecord((checkpoint / MODEL_STATES).stat().st_size)
    result = resume(small_dataset, run_dir, 1, "parallel.zero_stage=0")
    assert_resumed_exactly(result, run_dir, straight_run, DAMAGED)


@pytest.mark.slow
def test_generate_skips_a_checkpoint_with_non_finite_weights(straight_run: Path, tmp_path: Path):
    """consolidate.py checks too: generate takes the checkpoint before one whose weights hold NaN."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    file = checkpoint / MODEL_STATES
    overwrite_tensor_bytes(file, piece_tensor(file, EMBEDDING), NAN8)
    rewrite_checksum(checkpoint, MODEL_STATES)
    output = subprocess.run([*launcher(1), "generate", str(run_dir), "--max-new-tokens", "4"], cwd=REPO,
                            env=scaletrain_environment(), capture_output=True, text=True, timeout=600)
    assert output.returncode == 0, output.stderr[-3000:]
    assert f"skipping checkpoint {checkpoint}: checkpoint {checkpoint} holds non-finite values: weight " \
           f"{EMBEDDING} (8 of" in output.stderr
    assert output.stdout.strip()


@pytest.mark.slow
def test_a_changed_meta_json_makes_its_checkpoint_unloadable(
    small_dataset: Path, straight_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """meta.json was outside the CRC: its step changed 12 -> 20 resumed "at step 20 from step_00000012"
    (steps 13-20 never trained), and a changed consumed_samples shifted the data order, both with exit
    0. Either change is refused in one line now, and the checkpoint before is taken, as for any damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    newest, before = (run_dir / "checkpoints" / f"step_{step:08d}" for step in (STEPS, DAMAGED))
    sealed = json.loads((newest / "meta.json").read_text())
    for field in ("consumed_samples", "step"):
        (newest / "meta.json").write_text(json.dumps({**sealed, field: sealed[field] + 8}, indent=2))
        with pytest.raises(CheckpointError, match=rf"^checkpoint {newest}: meta.json has CRC-32 \w{{8}}, "
                                                  rf"{sealed[META_CHECKSUM]} was written: its fields"):
            read_meta(newest)
    assert main(["check", *overrides(small_dataset, run_dir)]) == 0
    out, err = capsys.readouterr()
    assert f"resumes at step {DAMAGED} of {STEPS} from {before}" in out
    assert f"warning: skipping checkpoint {newest}: checkpoint {newest}: meta.json has CRC-32" in err
    assert first_loadable(run_dir, consolidated_state_dict)[0] == before  # generate, export
    unsealed = {key: value for key, value in sealed.items() if key != META_CHECKSUM}  # written before the seal
    (newest / "meta.json").write_text(json.dumps(unsealed))
    assert read_meta(newest).step == STEPS
    (newest / "meta.json").write_text(json.dumps({**unsealed, "step": STEPS + 8}))
    with pytest.raises(CheckpointError, match=f"meta.json says step {STEPS + 8}, its directory is named for "
                                              f"step {STEPS}"):
        read_meta(newest)


def test_the_checksum_taken_while_saving_is_the_written_file_s(tmp_path: Path):
    state = {"weight": torch.randn(1000, 64), "step": 3, "nested": {"moment": torch.zeros(17)}}
    file = tmp_path / "state.pt"
    crc = save_with_checksum(state, file)
    assert crc == f"{zlib.crc32(file.read_bytes()):08x}" == file_checksum(file)
    records = {"state.pt": FileRecord(file.stat().st_size, crc)}
    assert torch.equal(CheckedFiles(tmp_path, records).load(file)["weight"], state["weight"])


def test_a_changed_value_is_refused_naming_the_checkpoint_file_and_fix(tmp_path: Path):
    file = tmp_path / "state" / "model.pt"
    file.parent.mkdir()
    weight = torch.randn(256)
    crc = save_with_checksum({"weight": weight}, file)
    records = {"state/model.pt": FileRecord(file.stat().st_size, crc)}
    overwrite_tensor_bytes(file, weight, torch.tensor([0.5]))
    with pytest.raises(CheckpointError, match=r"checkpoint .*: state/model.pt has CRC-32 \w{8}, \w{8} was written.*"
                                              r"resume from another checkpoint .* or delete"):
        CheckedFiles(tmp_path, records).load(file)
    size_only = {"state/model.pt": FileRecord(file.stat().st_size)}  # a checkpoint from before checksums
    CheckedFiles(tmp_path, size_only).load(file)


def test_non_finite_tensors_are_named_with_their_count(tmp_path: Path):
    check_finite(tmp_path, [("weight a", torch.ones(4)), ("steps", torch.arange(3))])
    poisoned = torch.ones(10)
    poisoned[[2, 5]] = float("nan")
    with pytest.raises(CheckpointError, match=r"holds non-finite values: weight b \(2 of 10 values\); "
                                              r"Adam exp_avg of b \(1 of 1 values\)"):
        check_finite(tmp_path, [("weight b", poisoned), ("Adam exp_avg of b", torch.tensor([float("-inf")]))])
