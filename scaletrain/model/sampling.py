"""Autoregressive sampling with temperature and top-k (Fan et al. 2018)."""

from __future__ import annotations

import torch
from torch import nn


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
) -> list[int]:
    """Extend `prompt` one token at a time; the model maps [1, seq] tokens to [1, seq, vocab] logits.

    Logits past `vocab_size` belong to padding rows of the embedding and are never sampled.
    """
    model.eval()
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-context_length:]], dtype=torch.long)
        logits = model(context)[0, -1, :vocab_size].float()
        next_token = _choose(logits, temperature, top_k, generator)
        tokens.append(next_token)
        if next_token == stop_token:
            break
    return tokens[len(prompt):]


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        threshold = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
