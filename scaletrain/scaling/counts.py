"""Exact parameter and training-FLOPs counts of every model family, for scaling laws and MFU.

N is reported as Kaplan et al. 2020 (sec. 2.1) and Hoffmann et al. 2022 count it: `total_params`
(every unique parameter, a tied output layer once; Chinchilla's N) and `non_embedding_params`
(without the lookup tables: word, position, segment and T5's relative-position tables; Kaplan's
N). An untied output layer (T5 v1.1) is a matrix multiply, so it counts as non-embedding.

FLOPs are model FLOPs of one training step, forward and backward, without recomputation: 2 per
multiply-accumulate of every matmul (weights and attention), times 3 for the backward pass's two
matmuls per forward one (Kaplan et al. 2020, table 1; Narayanan et al. 2021, eq. 3). They are
*not* 6N: attention scores and values (4·s·d_attn per token and layer, computed over the full
s x s square as our kernels do) and the LM head are included, embedding lookups, norms, softmax
and other elementwise work are not. FLOPs per token divide a sample's FLOPs by model.seq_length,
the tokens the loader consumes per sample, so D x flops_per_token is a run's compute. Counts use
the padded vocabulary (config.padded_vocab_size), which is what the output layer computes.
tests/scaling/test_counts.py checks both against the real models (parameters one by one, FLOPs
with torch's FlopCounterMode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.data.span_corruption import random_spans_helper
from scaletrain.scaling.params import total_parameters
from scaletrain.tracking.flops import model_flops_per_token


@dataclass(frozen=True)
class ModelCounts:
    total_params: int
    embedding_params: int
    flops_per_token: float
    flops_formula: str

    @property
    def non_embedding_params(self) -> int:
        return self.total_params - self.embedding_params


def model_counts(config: Config) -> ModelCounts:
    """Parameters (TP=1 totals) and training FLOPs per token of the model `config` builds."""
    return FAMILY_COUNTS[config.model.family](config)


def _transformer_block_flops(hidden: int, ffn: int, seq: int) -> int:
    """Forward FLOPs per token of one GPT/BERT block: QKV + output 8h^2, MLP 4h*ffn, attention 4hs."""
    return 8 * hidden * hidden + 4 * hidden * ffn + 4 * hidden * seq


def gpt_counts(config: Config) -> ModelCounts:
    model, vocab = config.model, config.padded_vocab_size
    embedding = vocab * model.hidden_size + model.seq_length * model.hidden_size
    return ModelCounts(
        total_params=total_parameters(config), embedding_params=embedding,
        flops_per_token=model_flops_per_token(model, vocab),
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + 2h·V) = 6N + 12·l·h·s with N the matmul weights "
                      "(Narayanan et al. 2021, eq. 3; PaLM app. B)",
    )


def bert_counts(config: Config, labelled_fraction: float | None = None) -> ModelCounts:
    """BERT computes the MLM head only at labelled positions (objective.mask_prob of the tokens on
    average, or `labelled_fraction` for one batch) and the sentence-order head once per sample."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, ffn, layers, seq = model.hidden_size, model.ffn_size, model.num_layers, model.seq_length
    pairs = config.objective.sentence_pairs != "none"
    block = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn  # QKV, output, fc, proj (+ biases), 2 LNs
    embedding = (vocab + seq + model.type_vocab_size) * hidden
    final_norm = 2 * hidden if model.layernorm_position == "pre" else 0
    head = hidden * hidden + 3 * hidden + vocab  # transform dense + bias, LayerNorm, decoder bias
    sentence_order = hidden * hidden + hidden + 2 * hidden + 2 if pairs else 0
    total = embedding + 2 * hidden + layers * block + final_norm + head + sentence_order
    fraction = config.objective.mask_prob if labelled_fraction is None else labelled_fraction
    head_flops = 2 * hidden * hidden + 2 * hidden * vocab
    per_token = layers * _transformer_block_flops(hidden, ffn, seq) + fraction * head_flops
    if pairs:
        per_token += (2 * hidden * hidden + 4 * hidden) / seq
    return ModelCounts(
        total_params=total, embedding_params=embedding, flops_per_token=3.0 * per_token,
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + p·(2h² + 2h·V) [+ (2h² + 4h)/s]) with p the labelled "
                      "fraction (objective.mask_prob)",
    )


def t5_counts(config: Config) -> ModelCounts:
    """Encoder over model.seq_length tokens, decoder over the objective's target length; every decoder
    layer projects the encoder output to keys and values, so that cost scales with the encoder length."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, inner = model.hidden_size, model.num_heads * model.attention_head_dim
    gates = 2 if model.ffn_activation == "gated-gelu" else 1
    encoder_layers, decoder_layers = model.num_layers, model.num_decoder_layers or model.num_layers
    encoder_length, decoder_length = model.seq_length, t5_decoder_length(config)
    ffn = (gates + 1) * hidden * model.ffn_size
    attention = 4 * hidden * inner  # QKV + output
    encoder_layer = attention + ffn + 2 * hidden
    decoder_layer = 2 * attention + ffn + 3 * hidden  # self + cross attention
    relative_tables = 2 * model.relative_attention_num_buckets * model.num_heads
    head = 0 if model.tie_embeddings else hidden * vocab
    total = (vocab * hidden + relative_tables + encoder_layers * encoder_layer + decoder_layers * decoder_layer
             + 2 * hidden + head)
    encoder_flops = encoder_length * encoder_layers * (2 * attention + 2 * ffn + 4 * inner * encoder_length)
    decoder_token = 2 * attention + 2 * 2 * hidden * inner + 2 * ffn + 4 * inner * (decoder_length + encoder_length)
    # ... and every decoder layer projects the encoder output to the cross-attention keys and values
    decoder_flops = decoder_layers * (decoder_length * decoder_token + encoder_length * 2 * 2 * hidden * inner)
    head_flops = decoder_length * 2 * hidden * vocab
    return ModelCounts(
        total_params=total, embedding_params=vocab * hidden + relative_tables,
        flops_per_token=3.0 * (encoder_flops + decoder_flops + head_flops) / encoder_length,
        flops_formula="3·(s_e·L_e·(8h·i + 2(g+1)h·f + 4i·s_e) + L_d·(s_d·(12h·i + 2(g+1)h·f + 4i·(s_d + s_e)) "
                      "+ 4h·i·s_e) + 2h·V·s_d) / s_e",
    )


def t5_decoder_length(config: Config) -> int:
    """Targets per sample: T5's span-corruption target length (sec. 3.1.4), or the full sequence for prefix LM."""
    objective = config.objective
    if objective.resolved_kind(config.model.family) == "prefix_lm":
        return config.model.seq_length
    return random_spans_helper(config.model.seq_length, objective.noise_density, objective.mean_noise_span_length)[1]


FAMILY_COUNTS: dict[str, Callable[[Config], ModelCounts]] = {"gpt": gpt_counts, "bert": bert_counts, "t5": t5_counts}
