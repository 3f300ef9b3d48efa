"""Scoring text with a model already loaded on this rank: the log-likelihood of a continuation after a context,
and the model's own continuation of a prompt, for a decoder-only LM or an encoder-decoder, in any layout of
tensor, sequence, context and pipeline parallelism. Every rank of one model replica scores the same requests and
ends with the same numbers:
  - tensor parallelism: the ranks gather the vocabulary shards of the logits;
  - sequence parallelism: a batch is padded to a multiple of the TP size (its log-likelihoods are those without);
  - context parallelism: a batch is padded to a multiple of 2 x CP, each rank scores the positions it holds
    (zigzag, parallel/context_parallel.py) and the ranks gather each other's;
  - pipeline stages: the batch goes through the stages (evaluation/pipeline_forward.py), the last scores it and
    sends the scores to the others.
The model's own continuation (one new token per forward behind a KV cache) runs on a whole model or its TP shard
only: under SP, CP and pipeline stages train/hooks/downstream.py refuses generate_until tasks, and `scaletrain
eval --tasks` leaves the stages out for them.

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
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from scaletrain.config import Config
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.families import get_family
from scaletrain.generate import Generation, continue_text, generation_of
from scaletrain.model.family import ModelFamily
from scaletrain.parallel.context_parallel import context_parallel_size, local_tokens, zigzag_positions
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


class TokenScores(NamedTuple):
    """Per position of a batch [batch, length]: the log-probability of the target token (fp32) and whether it is
    the argmax there."""

    log_probs: torch.Tensor
    greedy: torch.Tensor

    def of(self, row: int, start: int, end: int) -> tuple[float, bool]:
        """(summed log-probability, all greedy) of positions [start, end) of `row`."""
        return float(self.log_probs[row, start:end].sum()), bool(self.greedy[row, start:end].all())


# (the model's inputs by batch key, targets [batch, length]) -> TokenScores on every rank of the replica
ScoreForward = Callable[[dict[str, torch.Tensor], torch.Tensor], TokenScores]


def token_scores(local_logits: torch.Tensor, targets: torch.Tensor) -> TokenScores:
    """This rank's vocabulary shard of the logits [batch, seq, vocab / TP] scored against targets [batch, seq]
    (a vocabulary id at every position; what is scored at padding is not read), over the whole vocabulary in
    fp32."""
    log_probs = torch.log_softmax(gather_last_dim(local_logits).float(), dim=-1)
    chosen = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    return TokenScores(chosen, log_probs.argmax(dim=-1) == targets)


def model_forward(model: nn.Module) -> ScoreForward:
    """The scores of a model whose forward takes the batch keys and returns vocab-parallel logits [batch, seq,
    vocab / TP]: the whole sequence's, or under context parallelism this rank's positions (zigzag), which the
    context-parallel ranks then gather (`gathered_over_context`)."""

    def forward(inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> TokenScores:
        local = token_scores(model(**inputs), local_tokens(targets))
        return gathered_over_context(local, targets.shape[1])

    return forward


def gathered_over_context(local: TokenScores, length: int) -> TokenScores:
    """[batch, length] scores from each context-parallel rank's [batch, length / CP] at its zigzag positions (the
    scores themselves without context parallelism)."""
    size = context_parallel_size()
    if size == 1:
        return local
    group = parallel_state.get_context_parallel_group()
    stacked = torch.stack([local.log_probs, local.greedy.to(local.log_probs.dtype)])
    shards = [torch.empty_like(stacked) for _ in range(size)]
    dist.all_gather(shards, stacked.contiguous(), group=group)
    whole = torch.empty(2, stacked.shape[1], length, dtype=stacked.dtype, device=stacked.device)
    for rank, shard in enumerate(shards):
        whole[:, :, zigzag_positions(length, size, rank, stacked.device)] = shard
    return TokenScores(whole[0], whole[1].bool())


class Scorer:
    """Log-likelihoods and continuations from `model` (the config's family on this rank, on `device`), batch_size
    requests per forward, in eval mode (the model's mode is restored after each call). Under pipeline stages
    `model` is this rank's stage (model/pipeline.py TransformerPipeline)."""

    def __init__(self, model: nn.Module, config: Config, tokenizer: Tokenizer, device: torch.device,
                 batch_size: int = 8) -> None:
        family = get_family(config.model.family)
        check_scores(family, Path(config.run.dir))
        self.model, self.config, self.tokenizer, self.device = model, config, tokenizer, device
        self.batch_size = batch_size
        self.generation: Generation = generation_of(family, Path(config.run.dir))
        self.encoder_decoder = family.encoder_decoder
        self._forward = self._score_forward(model, config)

    @staticmethod
    def _score_forward(model: nn.Module, config: Config) -> ScoreForward:
        if config.parallel.pipeline == 1:
            return model_forward(model)
        from scaletrain.evaluation.pipeline_forward import pipeline_forward  # imports DeepSpeed

        return pipeline_forward(model)

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
        sequences = [(context + continuation)[-(self.context_length + 1):] for context, continuation in batch]
        tokens, _ = self._right_padded([sequence[:-1] for sequence in sequences])
        targets, _ = self._right_padded([sequence[1:] for sequence in sequences])
        scores = self._forward({"tokens": tokens}, targets)
        return [scores.of(row, len(sequence) - 1 - len(continuation), len(sequence) - 1)
                for row, (sequence, (_, continuation)) in enumerate(zip(sequences, batch, strict=True))]

    def _score_encoder_decoder(self, batch: list[Request]) -> list[tuple[float, bool]]:
        targets = [continuation[-self.context_length:] for _, continuation in batch]
        encoder_tokens, encoder_mask = self._right_padded([context[-self.context_length:] for context, _ in batch])
        start = self.generation.decoder_start_id(self.tokenizer)
        decoder_tokens, decoder_mask = self._right_padded([[start, *target[:-1]] for target in targets])
        padded_targets, _ = self._right_padded(targets, length=decoder_tokens.shape[1])
        scores = self._forward({"encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens,
                                "encoder_padding_mask": encoder_mask, "decoder_padding_mask": decoder_mask},
                               padded_targets)
        return [scores.of(row, 0, len(target)) for row, target in enumerate(targets)]

    def _right_padded(self, sequences: list[list[int]], length: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, length] token ids padded on the right with pad, and the mask of real tokens (1); the length is
        the longest sequence's, rounded up as the layout needs (`_forward_length`), unless given."""
        length = length or self._forward_length(max(map(len, sequences)))
        tokens = torch.full((len(sequences), length), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for row, sequence in enumerate(sequences):
            tokens[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
        return tokens.to(self.device), mask.to(self.device)

    def _forward_length(self, longest: int) -> int:
        """`longest`, rounded up to the next multiple of what splits a forward's sequence: the tensor-parallel
        size under sequence parallelism, 2 x the context-parallel size under context parallelism. More padding on
        the right changes no log-probability at a real position (a decoder attends causally; an encoder-decoder
        masks its encoder's padding), and it stays within model.seq_length, which those sizes divide
        (parallel/layout_rules.py)."""
        parallel = self.config.parallel
        multiple = math.lcm(parallel.tensor if parallel.sequence_parallel else 1,
                            2 * parallel.context if parallel.context > 1 else 1)
        return -(-longest // multiple) * multiple


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout), then back in the mode it was in: a training loop's model too."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
