"""`scaletrain export` / `scaletrain import`: Hugging Face checkpoints to and from a run's weights."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.manager import CheckpointError, first_loadable
from scaletrain.data.storage import dataset_location
from scaletrain.generate import run_config
from scaletrain.model import build_model
from scaletrain.model.registry import FAMILY_MODULES, get_family
from scaletrain.parallel.groups import destroy_distributed, init_distributed


def export_run(run_dir: Path, out_dir: Path) -> Path:
    """The newest checkpoint of `run_dir` that loads (manager.first_loadable), whatever its layout, as
    a transformers model directory (the family's HF adapter: GPT2LMHeadModel, BertForMaskedLM,
    T5ForConditionalGeneration, LlamaForCausalLM) plus our tokenizer files."""
    config = run_config(run_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose a new directory")
    init_distributed(config)
    try:
        reference = build_model(config)
        _, state = first_loadable(run_dir, lambda checkpoint: consolidated_state_dict(checkpoint, reference))
    finally:
        destroy_distributed()
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    get_family(config.model.family).hf().export(state, config, staging)
    for tokenizer_file in dataset_location(config.data).tokenizer_files():
        shutil.copy(tokenizer_file, staging / tokenizer_file.name)
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(staging, out_dir)
    return out_dir


def import_to_file(hf_dir: Path, family: str, out_file: Path) -> Path:
    """A transformers checkpoint as a TP=1 scaletrain state dict file, for `train.init_from`."""
    if family not in FAMILY_MODULES:
        raise CheckpointError(f"--family {family!r}; use one of {', '.join(FAMILY_MODULES)}")
    try:
        state = get_family(family).hf().import_(hf_dir)
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
