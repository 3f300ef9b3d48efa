"""`scaletrain export` / `scaletrain import`: Hugging Face checkpoints to and from a run's weights."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.hf_export import export_hf, import_hf
from scaletrain.checkpoint.hf_t5 import export_t5_hf, import_t5_hf
from scaletrain.checkpoint.manager import CheckpointError, latest_checkpoint
from scaletrain.config import load_config
from scaletrain.generate import single_process_config
from scaletrain.model import build_model, t5_architecture
from scaletrain.parallel.groups import destroy_distributed, init_distributed

FAMILIES = ("gpt", "bert", "t5")


def export_run(run_dir: Path, out_dir: Path) -> Path:
    """The latest checkpoint of `run_dir`, whatever its layout, as a transformers model directory
    (GPT2LMHeadModel, BertForMaskedLM or T5ForConditionalGeneration) plus our tokenizer files."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint to export; train first")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose a new directory")
    config = single_process_config(load_config(checkpoint / "config.yaml"))
    init_distributed(config)
    try:
        state = consolidated_state_dict(checkpoint, reference=build_model(config))
    finally:
        destroy_distributed()
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    if config.model.family == "t5":
        export_t5_hf(state, t5_architecture(config), staging)
    else:
        export_hf(state, config.model.family, config.model, config.padded_vocab_size, staging)
    for tokenizer_file in Path(config.data.dir).glob("tokenizer.*"):
        shutil.copy(tokenizer_file, staging / tokenizer_file.name)
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(staging, out_dir)
    return out_dir


def import_to_file(hf_dir: Path, family: str, out_file: Path) -> Path:
    """A transformers checkpoint as a TP=1 scaletrain state dict file, for `train.init_from`."""
    if family not in FAMILIES:
        raise CheckpointError(f"--family {family!r}; use one of {', '.join(FAMILIES)}")
    try:
        state = import_t5_hf(hf_dir) if family == "t5" else import_hf(hf_dir, family)
    except (pickle.UnpicklingError, OSError) as error:
        # transformers reads pytorch_model.bin with torch's restricted unpickler (weights_only=True)
        raise CheckpointError(
            f"{hf_dir} could not be read as a {family} model ({type(error).__name__}: {str(error).splitlines()[0]}); "
            "it must hold config.json and model.safetensors, or a pytorch_model.bin of plain tensors"
        ) from None
    temporary = out_file.with_name(out_file.name + ".partial")
    torch.save(state, temporary)
    os.replace(temporary, out_file)
    return out_file
