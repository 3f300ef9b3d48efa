"""`scaletrain export` / `scaletrain import`: Hugging Face checkpoints to and from a run's weights."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import CheckpointMeta, read_meta
from scaletrain.checkpoint.hf.tokenizer import write_hf_tokenizer
from scaletrain.config import Config
from scaletrain.data.storage import dataset_location
from scaletrain.data.tokenizer import SPECIAL_IDS
from scaletrain.families import FAMILIES, get_family
from scaletrain.model.family import ModelFamily
from scaletrain.run_config import announce_checkpoint, chosen_checkpoint, load_chosen, run_config

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# --dtype: the weights' type in the export (training keeps fp32 master weights), and its name in config.json
EXPORT_DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"),
                 "fp16": (torch.float16, "float16")}


def export_run(run_dir: Path, out_dir: Path, checkpoint: str | None = None, dtype: str = "fp32") -> Path:
    """`checkpoint` of `run_dir` (a directory, its name or its step: run_config.chosen_checkpoint), or its
    newest that loads (format.first_loadable), whatever its layout, as a transformers model directory
    (the family's HF adapter: GPT2LMHeadModel, BertForMaskedLM, T5ForConditionalGeneration,
    LlamaForCausalLM; ELECTRA's generator/ and discriminator/ side by side) with its weights in `dtype`
    (EXPORT_DTYPES), plus, beside each model, our tokenizer files and the Hugging Face ones made from them
    (hf/tokenizer.py) and, for a family that generates, a generation_config.json; every file readable by
    all as the umask allows.

    The files are written to a staging directory renamed to `out_dir` when complete; a failure or a stop
    signal (Ctrl-C, SIGTERM: ExportInterrupted) removes it, so `out_dir` appears whole or not at all."""
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype}; use one of {', '.join(EXPORT_DTYPES)}")
    chosen = chosen_checkpoint(run_dir, checkpoint) if checkpoint is not None else None
    config = run_config(run_dir, chosen)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not empty; choose a new directory")
    with _staging_beside(out_dir) as staging:
        # The checkpoint's index merges the weights: no model is built, so each weight is held once.
        loaded, (meta, state) = load_chosen(run_dir, chosen, _meta_and_weights)
        announce_checkpoint(loaded, meta.step)
        _write_model_dirs(state, config, staging, dtype)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    return out_dir


class ExportInterrupted(KeyboardInterrupt):
    """A stop signal ended the export; `signal` is its number. A KeyboardInterrupt, as Ctrl-C's is, so
    only the clean-up on the way out runs."""

    def __init__(self, number: int) -> None:
        super().__init__(signal.Signals(number).name)
        self.signal = number


@contextlib.contextmanager
def _staging_beside(out_dir: Path) -> Iterator[Path]:
    """A staging directory for `out_dir`, removed on the way out unless renamed to it: after a failure,
    Ctrl-C or SIGTERM too. Both signals raise ExportInterrupted meanwhile (Python's default for SIGTERM
    ends the process at once, without clean-up), and are ignored while the clean-up runs."""
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    previous = {number: signal.signal(number, _raise_interrupted) for number in STOP_SIGNALS}
    try:
        shutil.rmtree(staging, ignore_errors=True)
        yield staging
    finally:
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        shutil.rmtree(staging, ignore_errors=True)
        for number, handler in previous.items():
            signal.signal(number, handler)


def _raise_interrupted(number: int, frame: FrameType | None) -> None:
    raise ExportInterrupted(number)


def _meta_and_weights(checkpoint: Path) -> tuple[CheckpointMeta, dict[str, torch.Tensor]]:
    """meta.json and the merged weights, read together: the line naming the checkpoint's step needs no
    second read, which fails if a training run has pruned the checkpoint since (checkpoint.keep_last)."""
    return read_meta(checkpoint), consolidated_state_dict(checkpoint)


def _write_model_dirs(state: dict[str, torch.Tensor], config: Config, staging: Path, dtype: str) -> None:
    family = get_family(config.model.family)
    family.hf.export(state, config, staging)
    tokenizer_files = dataset_location(config.data).tokenizer_files()
    for model_dir in (staging / name for name in family.hf.model_dirs):
        for tokenizer_file in tokenizer_files:
            shutil.copy(tokenizer_file, model_dir / tokenizer_file.name)
        write_hf_tokenizer(model_dir / tokenizer_files[0].name, family, config.model.seq_length, model_dir)
        _write_generation_config(model_dir, family, config.model.seq_length)
        if dtype != "fp32":
            _cast_weights(model_dir, dtype)
    _give_ordinary_permissions(staging)


def _write_generation_config(model_dir: Path, family: ModelFamily, context_length: int) -> None:
    """generation_config.json: the special ids as `scaletrain generate` uses them, and max_length = the context
    (model.seq_length). Without it transformers' text-generation pipeline asks for 256 new tokens by default
    (5.24), past GPT-2's and BART's learned positions: an IndexError; with it a call left at its default length
    stops at the context. transformers checks no explicit max_new_tokens against the context (and, max_length
    being set, says both are): past it, it warns that the call "has exceeded the model's predefined maximum
    length" (config.max_position_embeddings, which every exported config with learned positions states), and
    the position table then raises the IndexError; `pipeline(..., handle_long_generation="hole")` refuses such a
    call in one line, or cuts the prompt to make room."""
    if family.generation is None:
        return
    from transformers import GenerationConfig

    model_config = json.loads((model_dir / "config.json").read_text())
    start = {"decoder_start_token_id": model_config["decoder_start_token_id"]} if family.encoder_decoder else {}
    GenerationConfig(max_length=context_length, bos_token_id=SPECIAL_IDS["bos"], eos_token_id=SPECIAL_IDS["eos"],
                     pad_token_id=SPECIAL_IDS["pad"], **start).save_pretrained(model_dir)


def _cast_weights(model_dir: Path, dtype: str) -> None:
    """The floating-point weights of the export in `dtype`, and config.json saying so (transformers loads them
    as they are stored, dtype="auto")."""
    from safetensors.torch import load_file, save_file

    torch_dtype, name = EXPORT_DTYPES[dtype]
    total_bytes = 0
    for weights_file in model_dir.glob("*.safetensors"):
        weights = {key: tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
                   for key, tensor in load_file(weights_file).items()}
        total_bytes += sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
        save_file(weights, weights_file, metadata={"format": "pt"})
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():  # sharded: the index states the bytes of the weights
        index = json.loads(index_file.read_text())
        index.setdefault("metadata", {})["total_size"] = total_bytes
        index_file.write_text(json.dumps(index, indent=2) + "\n")
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "dtype": name}, indent=2) + "\n")


def _give_ordinary_permissions(directory: Path) -> None:
    """Mode 0666 (0777 for folders) less the umask, for `directory` and everything in it.

    safetensors writes model.safetensors through a temporary file made 0600 and renamed (seen with
    strace on safetensors 0.8), which would leave the exported weights readable by their owner only.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in [directory, *directory.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def import_to_file(hf_dir: Path, family: str, out_file: Path) -> Path:
    """A transformers checkpoint as a TP=1 scaletrain state dict file, for `train.init_from`; the
    adapter reads it checked (hf/reading.py), and out_file appears whole or not at all."""
    if family not in FAMILIES:
        raise CheckpointError(f"--family {family!r}; use one of {', '.join(FAMILIES)}")
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory; give a Hugging Face model directory (config.json "
                              "and its weights, as save_pretrained writes them)")
    if out_file.is_dir() or not out_file.parent.is_dir():
        where = "is a directory" if out_file.is_dir() else f"is in {out_file.parent}, which is not a directory"
        raise CheckpointError(f"{out_file} {where}; give a file path in an existing directory, e.g. "
                              f"{hf_dir.name}.pt")
    try:
        state = get_family(family).hf.import_(hf_dir)
    except (pickle.UnpicklingError, OSError) as error:
        # transformers reads pytorch_model.bin with torch's restricted unpickler (weights_only=True)
        raise CheckpointError(
            f"{hf_dir} could not be read as a {family} model ({type(error).__name__}: {str(error).splitlines()[0]}); "
            "it must hold config.json and model.safetensors, or a pytorch_model.bin of plain tensors"
        ) from None
    temporary = out_file.with_name(out_file.name + ".partial")
    try:
        torch.save(state, temporary)
        os.replace(temporary, out_file)
    finally:
        temporary.unlink(missing_ok=True)
    return out_file
