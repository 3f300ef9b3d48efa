"""train.init_from: a file that is not there, not a state dict or not finite is refused in one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.init_weights import check_init_from, load_init_weights
from scaletrain.config import ConfigError
from scaletrain.config_loader import load_config

REPO = Path(__file__).resolve().parents[2]


def _truncated(path: Path) -> Path:
    torch.save({"weight": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:600])
    return path


@pytest.mark.parametrize(("write", "message"), [
    pytest.param(lambda path: path, "does not exist; give the file `scaletrain import HF_DIR OUT_FILE --family "
                 "FAMILY` wrote", id="missing"),
    pytest.param(_truncated, "is not a readable weights file (RuntimeError: PytorchStreamReader failed",
                 id="truncated"),
    pytest.param(lambda path: torch.save([torch.ones(2)], path) or path,
                 "holds a list, not a state dict of named tensors", id="not a state dict"),
    pytest.param(lambda path: torch.save({"a": torch.ones(4), "b": torch.tensor([1.0, float("nan"), float("inf")]),
                                          "c": torch.full((3,), float("-inf")), "steps": torch.tensor([7])},
                                         path) or path,
                 "holds non-finite values: b (2 of 3 values); c (3 of 3 values); training from it would give NaN",
                 id="non-finite"),
])
def test_a_bad_init_from_file_is_refused_naming_it(tmp_path: Path, write, message: str):
    path = write(tmp_path / "weights.pt")
    with pytest.raises((ConfigError, CheckpointError)) as error:
        load_init_weights(path)
    assert str(error.value).startswith(f"train.init_from={path} "), str(error.value)
    assert message in str(error.value), str(error.value)


def test_init_from_is_checked_before_the_run_directory_is_made(tmp_path: Path):
    run_dir = tmp_path / "run"
    for init_from, what in ((tmp_path / "missing.pt", "does not exist"), (tmp_path, "is a directory")):
        config = load_config(REPO / "configs" / "gpt_tiny.yaml", [f"train.init_from={init_from}", f"run.dir={run_dir}"])
        with pytest.raises(ConfigError, match=f"train.init_from={init_from} {what}"):
            check_init_from(config)
    assert not run_dir.exists()
