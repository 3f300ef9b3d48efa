"""Scoring text with a model already loaded on this rank: the log-likelihood of a continuation after a context,
and the model's own continuation of a prompt, for a decoder-only LM or an encoder-decoder, in any
tensor-parallel layout (every rank of a TP group scores the same requests and gathers the vocabulary shards).
Under sequence parallelism a batch is padded to a multiple of the TP size, and its log-likelihoods are those
without it; the model's own continuation (one new token per forward) cannot run there (train/hooks/downstream.py
refuses generate_until tasks).

It is what lm-evaluation-harness asks of a model (evaluation/harness.py adapts it), without the harness, so the
training loop can score its own model in place. The rules are those of lm-eval's `hf` backend
(models/huggingface.py, 0.4.13), so a run's export scored there gives the same numbers:
  - a decoder-only LM reads context + continuation less the last token, cut from the left to the last
    `context_length` tokens, and its log-probabilities at the continuation's positions are summed;
  - an encoder-decoder reads the context (its last `context_length` tokens) in its encoder and the continuation
    (its last `context_length`), behind the decoder's start token, in its decoder;
  - log-probabilities are over the whole padded vocabulary, as training's loss and the export's softmax;
  - `is_greedy`: every continuation token is the argmax at its position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from scaletrain.config import Config
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families import get_family
from scaletrain.generate import Generation, continue_text, generation_of
from scaletrain.model.family import ModelFamily
from scaletrain.parallel.sharding import gather_last_dim

# (context token ids, continuation token ids): score the continuation after the context
Request = tuple[list[int], list[int]]


class NotScoringError(ValueError):
    """The run's model family cannot score text left to right; the message says why."""


def check_scores(family: ModelFamily, run_dir: Path) -> None:
    """NotScoringError, in one line saying why, for a family whose model cannot score a continuation (an encoder:
    BERT, ALBERT, ELECTRA); the same families cannot generate."""
    if family.generation is None:
        raise NotScoringError(f"{run_dir} trained a {family.name} model, which lm-evaluation-harness cannot "
                              f"evaluate: its tasks score or generate text left to right, and "
                              f"{family.not_generating_reason}")


class Scorer:
    """Log-likelihoods and continuations from `model` (the config's family on this rank, on `device`), batch_size
    requests per forward, in eval mode (the model's mode is restored after each call)."""

    def __init__(self, model: nn.Module, config: Config, tokenizer: Tokenizer, device: torch.device,
                 batch_size: int = 8) -> None:
        family = get_family(config.model.family)
        check_scores(family, Path(config.run.dir))
        self.model, self.config, self.tokenizer, self.device = model, config, tokenizer, device
        self.batch_size = batch_size
        self.generation: Generation = generation_of(family, Path(config.run.dir))
        self.encoder_decoder = family.encoder_decoder

    @property
    def context_length(self) -> int:
        """The most tokens the model reads at once: the length it trained on (an export's max_position_embeddings,
        or its tokenizer's model_max_length)."""
        return self.config.model.seq_length

    @torch.no_grad()
    def loglikelihoods(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) per request, in
        order; longest first in batches, as lm-eval's hf backend batches them."""
        for context, continuation in requests:
            if not context or not continuation or len(continuation) > self.context_length:
                raise ValueError(f"a request of {len(context)} context and {len(continuation)} continuation tokens: "
                                 f"both must be non-empty, the continuation at most the model's "
                                 f"{self.context_length} tokens")
        order = sorted(range(len(requests)), key=lambda index: -sum(map(len, requests[index])))
        scores: dict[int, tuple[float, bool]] = {}
        score_batch = self._score_encoder_decoder if self.encoder_decoder else self._score_decoder
        with _evaluating(self.model):
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                scores.update(zip(batch, score_batch([requests[index] for index in batch]), strict=True))
        return [scores[index] for index in range(len(requests))]

    def continue_text(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                      seed: int = 0) -> str:
        """The text the model writes after `prompt`, as `scaletrain generate` writes it (greedy at temperature 0,
        with the KV cache)."""
        with _evaluating(self.model):
            return continue_text(self.generation, self.model, self.config, self.tokenizer, prompt, max_new_tokens,
                                 temperature, top_k, seed)

    def _score_decoder(self, batch: list[Request]) -> list[tuple[float, bool]]:
        inputs = [(context + continuation)[-(self.context_length + 1):][:-1] for context, continuation in batch]
        tokens, _ = self._right_padded(inputs)
        log_probs = _full_log_probs(self.model(tokens))
        return [_score(log_probs[row, len(inp) - len(continuation):len(inp)], continuation)
                for row, (inp, (_, continuation)) in enumerate(zip(inputs, batch, strict=True))]

    def _score_encoder_decoder(self, batch: list[Request]) -> list[tuple[float, bool]]:
        targets = [continuation[-self.context_length:] for _, continuation in batch]
        encoder_tokens, encoder_mask = self._right_padded([context[-self.context_length:] for context, _ in batch])
        start = self.generation.decoder_start_id(self.tokenizer)
        decoder_tokens, _ = self._right_padded([[start, *target[:-1]] for target in targets])
        log_probs = _full_log_probs(self.model(encoder_tokens=encoder_tokens, decoder_tokens=decoder_tokens,
                                               encoder_padding_mask=encoder_mask))
        return [_score(log_probs[row, :len(target)], target) for row, target in enumerate(targets)]

    def _right_padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, length] token ids padded on the right with pad, and the mask of real tokens (1); the length is
        the longest sequence's, rounded up under sequence parallelism (`_forward_length`)."""
        length = self._forward_length(max(map(len, sequences)))
        tokens = torch.full((len(sequences), length), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for row, sequence in enumerate(sequences):
            tokens[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
        return tokens.to(self.device), mask.to(self.device)

    def _forward_length(self, longest: int) -> int:
        """`longest`, or under sequence parallelism the next multiple of the tensor-parallel size: that forward
        splits the sequence over the TP ranks. More padding on the right changes no log-probability at a real
        position (a decoder attends causally; an encoder-decoder masks its encoder's padding), and it stays within
        model.seq_length, which the TP size divides under SP (parallel/layout_rules.py)."""
        parallel = self.config.parallel
        multiple = parallel.tensor if parallel.sequence_parallel else 1
        return -(-longest // multiple) * multiple


def _full_log_probs(local_logits: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary shard of the logits [batch, seq, vocab / TP] -> fp32 log-probabilities over the
    whole vocabulary [batch, seq, vocab]."""
    return torch.log_softmax(gather_last_dim(local_logits).float(), dim=-1)


def _score(log_probs: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """log_probs [len(continuation), vocab] at the continuation's positions."""
    targets = torch.tensor(continuation, device=log_probs.device)
    chosen = log_probs.gather(-1, targets[:, None])
    return float(chosen.sum()), bool((log_probs.argmax(dim=-1) == targets).all())


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout), then back in the mode it was in: a training loop's model too."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
