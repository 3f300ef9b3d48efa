"""`scaletrain generate`: sample from a run's checkpoint (--checkpoint, or the newest that loads), whatever layout
trained it; the same continuation serves lm-evaluation-harness's generate_until (evaluation/harness.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from scaletrain.checkpoint.consolidate import consolidated_state_dict
from scaletrain.checkpoint.errors import CheckpointError
from scaletrain.checkpoint.format import CheckpointMeta, read_meta
from scaletrain.config import Config
from scaletrain.data.storage import dataset_location
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families import build_model, get_family
from scaletrain.model.family import ModelFamily
from scaletrain.model.sampling import sample_seq2seq, sample_tokens
from scaletrain.parallel.groups import destroy_distributed, init_distributed
from scaletrain.run_config import announce_checkpoint, chosen_checkpoint, load_chosen, run_config


class NotGeneratingError(ValueError):
    """The run's model family cannot generate text; the message says why and what to use instead."""


def generate_text(
    run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int,
    checkpoint: str | None = None,
) -> str:
    """`prompt` and its continuation, sampled the way the run's family generates (`ModelFamily.generation`),
    from `checkpoint` (a directory, its name or its step: run_config.chosen_checkpoint) or the newest that loads."""
    chosen = chosen_checkpoint(run_dir, checkpoint) if checkpoint is not None else None
    config = run_config(run_dir, chosen)
    generation = generation_of(get_family(config.model.family), run_dir)
    init_distributed(config)
    try:
        loaded, (meta, model) = load_chosen(run_dir, chosen, partial(load_snapshot, config))
        announce_checkpoint(loaded, meta.step)
        tokenizer = Tokenizer.load(dataset_location(config.data).tokenizer_path())
        continuation = continue_text(generation, model, config, tokenizer, prompt, max_new_tokens, temperature, top_k,
                                     seed)
    finally:
        destroy_distributed()
    return prompt + continuation


def continue_text(
    generation: Generation, model: torch.nn.Module, config: Config, tokenizer: Tokenizer, prompt: str,
    max_new_tokens: int, temperature: float, top_k: int | None, seed: int,
) -> str:
    """The text `model` writes after `prompt` (at most max_new_tokens; the eos that ends it is not written):
    `scaletrain generate`'s, and lm-evaluation-harness's generate_until (evaluation/harness.py)."""
    new_ids = generation.continue_prompt(model, config, tokenizer, prompt, max_new_tokens, temperature, top_k,
                                         torch.Generator().manual_seed(seed))
    return tokenizer.decode([token for token in new_ids if token != tokenizer.eos_id])


@dataclass(frozen=True)
class Generation:
    """One way a family's model generates, as its spec names it (`ModelFamily.generation`): how a
    prompt is framed as in training and which sampler (model/sampling.py) continues it."""

    name: str
    # An encoder-decoder's first decoder token, by its Tokenizer name: pad for T5 (data/seq2seq.py shifts
    # targets right behind it), eos for BART (families/bart/noising.py); None: a decoder-only LM.
    decoder_start: str | None = None

    def frame(self, tokenizer: Tokenizer, ids: list[int]) -> list[int]:
        """A text's ids as training framed them: a decoder-only LM's documents follow an eos in the packed
        stream; an encoder's inputs end with one (the export's tokenizer adds the same: hf/tokenizer.py)."""
        return [tokenizer.eos_id, *ids] if self.decoder_start is None else [*ids, tokenizer.eos_id]

    def decoder_start_id(self, tokenizer: Tokenizer) -> int:
        return getattr(tokenizer, f"{self.decoder_start}_id")

    def continue_prompt(
        self, model: torch.nn.Module, config: Config, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
        temperature: float, top_k: int | None, generator: torch.Generator,
    ) -> list[int]:
        """The new token ids after `prompt`, up to and including the eos that ends them."""
        prompt_ids = self.frame(tokenizer, tokenizer.encode(prompt))
        if self.decoder_start is None:  # with a KV cache
            return sample_tokens(model, prompt_ids, max_new_tokens, config.model.seq_length, tokenizer.vocab_size,
                                 temperature, top_k, generator, stop_token=tokenizer.eos_id)
        return sample_seq2seq(model, prompt_ids, max_new_tokens, tokenizer.vocab_size, temperature, top_k, generator,
                              start_token=self.decoder_start_id(tokenizer), stop_token=tokenizer.eos_id)


GENERATIONS = {generation.name: generation for generation in (
    Generation("causal"),  # a decoder-only LM
    Generation("seq2seq", decoder_start="pad"),  # an encoder reads the prompt, the decoder writes the output
    Generation("seq2seq_eos_start", decoder_start="eos"),  # the same, BART's start
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
