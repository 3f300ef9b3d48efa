"""train.init_from: the weights file `scaletrain import` writes, checked before a run starts from it.

The file is checked to exist before the run directory is made (`check_init_from`), so a typo in its
path leaves no empty run behind, and its tensors are checked finite when it loads (`load_init_weights`):
a NaN imported from a broken Hugging Face checkpoint would otherwise train into a divergence that
blames the run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.integrity import nonfinite_tensors
from scaletrain.checkpoint.resume_policy import resume_candidates
from scaletrain.checkpoint.safe_load import load_tensors
from scaletrain.config import Config, ConfigError

IMPORT_HINT = ("give the file `scaletrain import HF_DIR OUT_FILE --family FAMILY` wrote, or leave train.init_from "
               "unset (a training checkpoint is resumed with train.resume=DIR, or branched from with "
               "train.branch_from=DIR)")


def check_init_from(config: Config) -> None:
    """Refuse a train.init_from that is not a file, where the run will start from it (it has no
    checkpoint to resume): before the run directory is made."""
    path = config.train.init_from
    if path is None or Path(path).is_file() or resume_candidates(config):
        return
    what = "is a directory, not a weights file" if Path(path).is_dir() else "does not exist"
    raise ConfigError(f"train.init_from={path} {what}; {IMPORT_HINT}")


def load_init_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights of train.init_from, unpickled restricted (safe_load.py), each tensor finite."""
    try:
        weights = load_tensors(path)
    except FileNotFoundError:
        raise ConfigError(f"train.init_from={path} does not exist; {IMPORT_HINT}") from None
    except (RuntimeError, EOFError, KeyError) as error:  # torch.load's answers to a truncated or foreign file
        raise CheckpointError(f"train.init_from={path} is not a readable weights file ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else 'no detail'}); {IMPORT_HINT}") from None
    if not isinstance(weights, dict) or not all(isinstance(tensor, torch.Tensor) for tensor in weights.values()):
        raise CheckpointError(f"train.init_from={path} holds a {type(weights).__name__}, not a state dict of "
                              f"named tensors; {IMPORT_HINT}")
    nonfinite = nonfinite_tensors(weights.items())
    if nonfinite:
        raise CheckpointError(f"train.init_from={path} holds non-finite values: {nonfinite}; training from it "
                              "would give NaN. Import it again from a checkpoint whose weights are finite")
    return weights
