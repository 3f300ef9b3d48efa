"""`scaletrain generate`: sample from a run's newest checkpoint that loads, whatever layout trained it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.manager import CheckpointError, CheckpointMeta, first_loadable, read_meta
from scaletrain.checkpoint.run_config import announce_checkpoint, run_config
from scaletrain.config import Config
from scaletrain.data.storage import dataset_location
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.model import build_model
from scaletrain.model.family import ModelFamily
from scaletrain.model.registry import get_family
from scaletrain.model.sampling import sample_seq2seq, sample_tokens
from scaletrain.parallel.groups import destroy_distributed, init_distributed


class NotGeneratingError(ValueError):
    """The run's model family cannot generate text; the message says why and what to use instead."""


def generate_text(
    run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int
) -> str:
    """`prompt` and its continuation, sampled the way the run's family generates (`ModelFamily.generation`)."""
    config = run_config(run_dir)
    generation = generation_of(get_family(config.model.family), run_dir)
    init_distributed(config)
    try:
        checkpoint, (meta, model) = first_loadable(run_dir, partial(load_snapshot, config))
        announce_checkpoint(checkpoint, meta.step)
        tokenizer = Tokenizer.load(dataset_location(config.data).tokenizer_path())
        new_ids = generation.continue_prompt(model, config, tokenizer, prompt, max_new_tokens, temperature, top_k,
                                             torch.Generator().manual_seed(seed))
    finally:
        destroy_distributed()
    return prompt + tokenizer.decode([token for token in new_ids if token != tokenizer.eos_id])


def _continue_causal(
    model: torch.nn.Module, config: Config, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
    temperature: float, top_k: int | None, generator: torch.Generator,
) -> list[int]:
    # Training packs documents behind an eos separator, so a prompt starts after one.
    prompt_ids = [tokenizer.eos_id, *tokenizer.encode(prompt)]
    return sample_tokens(model, prompt_ids, max_new_tokens, config.model.seq_length, tokenizer.vocab_size,
                         temperature, top_k, generator, stop_token=tokenizer.eos_id)


def _continue_seq2seq(
    model: torch.nn.Module, config: Config, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
    temperature: float, top_k: int | None, generator: torch.Generator, decoder_start: str = "pad",
) -> list[int]:
    # The encoder saw inputs ending in eos and the decoder started from `decoder_start`: pad for T5
    # (data/seq2seq.py), eos for BART (data/bart_noising.py).
    prompt_ids = [*tokenizer.encode(prompt), tokenizer.eos_id]
    return sample_seq2seq(model, prompt_ids, max_new_tokens, tokenizer.vocab_size, temperature, top_k, generator,
                          start_token=getattr(tokenizer, f"{decoder_start}_id"), stop_token=tokenizer.eos_id)


# (model, config, tokenizer, prompt, max_new_tokens, temperature, top_k, generator) -> new token ids
ContinuePrompt = Callable[
    [torch.nn.Module, Config, Tokenizer, str, int, float, int | None, torch.Generator], list[int]]


@dataclass(frozen=True)
class Generation:
    """One way a family's model generates, as its spec names it (`ModelFamily.generation`): how a
    prompt is framed as in training and which sampler (model/sampling.py) continues it."""

    name: str
    continue_prompt: ContinuePrompt


GENERATIONS = {generation.name: generation for generation in (
    Generation("causal", _continue_causal),  # a decoder-only LM with a KV cache
    Generation("seq2seq", _continue_seq2seq),  # an encoder reads the prompt, the decoder writes the output
    Generation("seq2seq_eos_start", partial(_continue_seq2seq, decoder_start="eos")),  # the same, BART's start
)}


def generation_of(family: ModelFamily, run_dir: Path) -> Generation:
    """The family's registered generation; NotGeneratingError, saying why, for one that cannot generate."""
    if family.generation is None:
        raise NotGeneratingError(f"{run_dir} trained a {family.name} model, which cannot generate: "
                                 f"{family.not_generating_reason}")
    if family.generation not in GENERATIONS:
        raise ValueError(f"model family {family.name} names generation {family.generation!r}, which is not "
                         f"registered; the known ones are {', '.join(GENERATIONS)} (generate.py GENERATIONS)")
    return GENERATIONS[family.generation]


def load_snapshot(config: Config, checkpoint: Path) -> tuple[CheckpointMeta, torch.nn.Module]:
    """A checkpoint's meta.json and model, read together: a command that uses them never reads the
    checkpoint again, which a training run may prune meanwhile (checkpoint.keep_last)."""
    return read_meta(checkpoint), load_model(config, checkpoint)


def load_model(config: Config, checkpoint: Path) -> torch.nn.Module:
    model = build_model(config)
    missing, unexpected = model.load_state_dict(consolidated_state_dict(checkpoint, expected=model), strict=False)
    # megatron's linear layers keep an empty `_extra_state` entry that checkpoints need not carry.
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not match the model: missing {missing}, extra {unexpected}"
        )
    return model.eval()
