"""Autoregressive sampling with temperature and top-k (Fan et al. 2018), decoding with a KV cache."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.model.layers import KVCache
from scaletrain.parallel.sharding import gather_last_dim


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    context_length: int,
    vocab_size: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    stop_token: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Extend `prompt` one token at a time with a causal LM (`model(tokens, cache=...)` maps
    [1, seq] tokens to [1, seq, vocab / TP] logits); returns the new tokens.

    With `use_cache` the prompt is prefilled once and each step feeds only the newest token. The
    model sees at most `context_length` tokens (GPT's learned positions end at seq_length): when
    the next token would not fit, the cache restarts from the last context_length tokens (the last
    context_length - 1 plus the new one), re-prefilled into a fresh cache. Cached keys cannot simply
    be shifted, because each depends on the earlier tokens and positions it was computed with, so
    past the context every step costs one full-window forward, as without the cache — and gives
    exactly the logits of recomputation on tokens[-context_length:]. `use_cache=False` recomputes
    the whole window every step (the reference in tests and benchmarks).
    Logits past `vocab_size` belong to padding rows of the embedding and are never sampled.
    """
    if not prompt:
        raise ValueError("sampling needs a prompt of at least one token (scaletrain generate starts it with eos)")
    model.eval()
    next_logits = _CachedWindow(model, context_length) if use_cache else _RecomputedWindow(model, context_length)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = next_logits(tokens)[:vocab_size].float()
        next_token = _choose(logits, temperature, top_k, generator)
        tokens.append(next_token)
        if next_token == stop_token:
            break
    return tokens[len(prompt):]


class _RecomputedWindow:
    """Full-vocabulary logits after the last token, from one forward over the whole window."""

    def __init__(self, model: nn.Module, context_length: int) -> None:
        self.model, self.context_length = model, context_length

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        window = torch.tensor([tokens[-self.context_length:]], dtype=torch.long)
        return gather_last_dim(self.model(window)[0, -1])


class _CachedWindow:
    """Full-vocabulary logits after the last token, feeding the model only tokens it has not seen."""

    def __init__(self, model: nn.Module, context_length: int) -> None:
        self.model, self.context_length = model, context_length
        self.cache: KVCache | None = None
        self.consumed = 0  # tokens of the sequence the cache has seen

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        new = tokens[self.consumed:]
        if self.cache is None or self.cache.length + len(new) > self.context_length:
            self.cache = KVCache.empty()
            new = tokens[-self.context_length:]
        self.consumed = len(tokens)
        logits = self.model(torch.tensor([new], dtype=torch.long), cache=self.cache)
        return gather_last_dim(logits[0, -1])


@torch.no_grad()
def sample_seq2seq(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    vocab_size: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    start_token: int = 0,
    stop_token: int | None = None,
) -> list[int]:
    """An encoder-decoder's output for `prompt_ids` (T5: `encode`, `decode`, `output_logits`).

    The prompt is encoded once; the decoder starts from `start_token` (T5's decoder_start_token_id
    is pad, 0: data/seq2seq.py shifts targets right behind it) and, with a KV cache, feeds one token
    per step until `stop_token` (eos, which ends every target) or max_new_tokens.
    """
    model.eval()
    encoder_output = model.encode(torch.tensor([prompt_ids], dtype=torch.long))
    cache = KVCache.empty()
    tokens = [start_token]
    for _ in range(max_new_tokens):
        decoded = model.decode(torch.tensor([tokens[-1:]], dtype=torch.long), encoder_output, cache=cache)
        logits = gather_last_dim(model.output_logits(decoded)[-1, 0])[:vocab_size].float()
        next_token = _choose(logits, temperature, top_k, generator)
        tokens.append(next_token)
        if next_token == stop_token:
            break
    return tokens[1:]


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        threshold = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
