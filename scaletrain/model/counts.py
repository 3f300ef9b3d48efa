"""Exact parameter and training-FLOPs counts of a model, by its family's own `counts` (its spec).

Each family's model.py (families/<name>/) counts its own model and `families.model_counts` asks it;
this module holds what
they share and what every count means.

N is reported as Kaplan et al. 2020 (sec. 2.1) and Hoffmann et al. 2022 count it: `total_params`
(every unique parameter, a tied output layer once; Chinchilla's N) and `non_embedding_params`
(without the lookup tables: word, position, segment and T5's relative-position tables; Kaplan's
N). An untied output layer (T5 v1.1) is a matrix multiply that costs 2h·V FLOPs per token, so it
counts as non-embedding (Pythia, for one, counts it as embedding instead).

FLOPs are model FLOPs of one training step, forward and backward, without recomputation: 2 per
multiply-accumulate of every matmul (weights and attention), times 3 for the backward pass's two
matmuls per forward one (Kaplan et al. 2020, table 1: C_forward ≈ 2N + 2·n_layer·n_ctx·d_attn;
Narayanan et al. 2021, eq. 3; Chowdhery et al. 2022 (PaLM), app. B: 6N + 12·l·h·s). They are
*not* 6N: attention scores and values (4·s·d_attn per token and layer, over the full s x s square
even where a causal kernel skips half of it, as these papers count it) and the LM head are included;
embedding lookups, biases, norms, activations, softmax, residual adds and the cross-entropy are
elementwise and are not (the model-FLOPs convention; they are O(s·h) per layer and sample, next
to O(s·h²) for the matmuls). FLOPs per token divide a sample's FLOPs by model.seq_length, the
tokens the trainer counts per sample, so tokens x flops_per_token is a run's compute.

The vocabulary is the padded one (config.padded_vocab_size): the output layer computes logits
for every padded row, and the word table holds them, so both are counted.
tests/model/test_counts.py checks every family against the real models: parameters one by
one, FLOPs with torch's FlopCounterMode on a batch from the family's own objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelCounts:
    """N (total and non-embedding) and training FLOPs per token of one model, at TP=1.

    A mixture-of-experts model also has `active_params`: what one token meets, its k routed experts
    of each MoE layer instead of all E (Mixtral 8x7B: 46.7B total, 12.9B active; Jiang et al. 2024,
    sec. 2.1). A dense model's are its total."""

    total_params: int
    embedding_params: int
    non_embedding_params: int = field(init=False)
    flops_per_token: float
    flops_formula: str
    active_params: int | None = None  # None: all of them (a dense model)

    def __post_init__(self) -> None:
        object.__setattr__(self, "non_embedding_params", self.total_params - self.embedding_params)
        if self.active_params is None:
            object.__setattr__(self, "active_params", self.total_params)

    @property
    def active_non_embedding_params(self) -> int:
        return self.active_params - self.embedding_params

    @property
    def sparse(self) -> bool:
        return self.active_params != self.total_params


@dataclass(frozen=True)
class MLPCounts:
    """One block's MLP: its parameters, those a token uses, and its forward FLOPs per token."""

    params: int
    active_params: int
    forward_flops: int


def mlp_counts(moe, layer: int, hidden: int, weights: int, biases: int) -> MLPCounts:
    """Block `layer`'s MLP (`moe` a model/moe.py MoEConfig), whose one dense MLP or expert holds `weights`
    matmul weights (2·h·ffn, gated 3·h·ffn) and `biases`: forward 2 FLOPs per weight. A MoE layer adds the
    router (h·E weights, 2·h·E FLOPs) and runs top_k experts per token (counted dropless: capacity drops
    only remove work)."""
    one = weights + biases
    if not moe.is_moe_layer(layer):
        return MLPCounts(one, one, 2 * weights)
    router = hidden * moe.num_experts
    return MLPCounts(moe.num_experts * one + router, moe.top_k * one + router, 2 * (moe.top_k * weights + router))


def transformer_block_flops(hidden: int, ffn: int, seq: int) -> int:
    """Forward FLOPs per token of one GPT/BERT block (Kaplan et al. 2020, table 1): QKV + output
    8h², MLP 4h·ffn, attention scores and values 4h·s."""
    return 8 * hidden * hidden + 4 * hidden * ffn + 4 * hidden * seq
