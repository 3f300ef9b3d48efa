"""Exact parameter and training-FLOPs counts of every model family, for scaling laws and MFU.

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
tests/scaling/test_counts.py checks every family against the real models: parameters one by
one, FLOPs with torch's FlopCounterMode on a batch from the family's own objective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scaletrain.config import Config
from scaletrain.data.masking import masking_budget
from scaletrain.data.span_corruption import random_spans_helper
from scaletrain.scaling.params import total_parameters
from scaletrain.tracking.flops import model_flops_per_token


@dataclass(frozen=True)
class ModelCounts:
    """N (total and non-embedding) and training FLOPs per token of one model, at TP=1."""

    total_params: int
    embedding_params: int
    non_embedding_params: int = field(init=False)
    flops_per_token: float
    flops_formula: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "non_embedding_params", self.total_params - self.embedding_params)


def model_counts(config: Config) -> ModelCounts:
    """Parameters (TP=1 totals) and training FLOPs per token of the model `config` builds."""
    return FAMILY_COUNTS[config.model.family](config)


def _transformer_block_flops(hidden: int, ffn: int, seq: int) -> int:
    """Forward FLOPs per token of one GPT/BERT block (Kaplan et al. 2020, table 1): QKV + output
    8h², MLP 4h·ffn, attention scores and values 4h·s."""
    return 8 * hidden * hidden + 4 * hidden * ffn + 4 * hidden * seq


def gpt_counts(config: Config) -> ModelCounts:
    """The tied output layer computes logits at every position: Narayanan et al. 2021, eq. 3
    (6hV for the head), shared with MFU reporting through tracking/flops.py."""
    model, vocab = config.model, config.padded_vocab_size
    embedding = vocab * model.hidden_size + model.seq_length * model.hidden_size
    return ModelCounts(
        total_params=total_parameters(config), embedding_params=embedding,
        flops_per_token=model_flops_per_token(model, vocab),
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + 2h·V) = 6N + 12·l·h·s + 6h·V with N the block weights "
                      "(Narayanan et al. 2021, eq. 3; PaLM app. B)",
    )


def bert_labelled_positions(config: Config) -> int:
    """Positions per sample the MLM head runs on: the collator's budget round(mask_prob · n) of the
    n non-special tokens (data/masking.py), n = seq_length - 2 for packed `[CLS] text [SEP]`, - 3 for
    `[CLS] A [SEP] B [SEP]` pairs. Exact for a sample without document boundaries; an eos between
    documents, a padded short pair or a whole word that no longer fits the budget make it fewer."""
    special = 3 if config.objective.sentence_pairs != "none" else 2
    return masking_budget(config.model.seq_length - special, config.objective.mask_prob)


def bert_counts(config: Config, labelled_positions: float | None = None) -> ModelCounts:
    """BERT's encoder blocks as GPT's (Kaplan et al. 2020, table 1, without the causal mask); the MLM
    head (transform 2h² + decoder 2h·V) runs only at labelled positions, as BERT's run_pretraining.py
    gathers them first (`bert_labelled_positions`, or `labelled_positions` per sample of one batch),
    and the sentence-order head (pooler 2h² + classifier 4h) once per sample."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, ffn, layers, seq = model.hidden_size, model.ffn_size, model.num_layers, model.seq_length
    pairs = config.objective.sentence_pairs != "none"
    block = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn  # QKV, output, fc, proj (+ biases), 2 LNs
    embedding = (vocab + seq + model.type_vocab_size) * hidden
    final_norm = 2 * hidden if model.layernorm_position == "pre" else 0
    head = hidden * hidden + 3 * hidden + vocab  # transform dense + bias, LayerNorm, decoder bias
    sentence_order = hidden * hidden + hidden + 2 * hidden + 2 if pairs else 0
    total = embedding + 2 * hidden + layers * block + final_norm + head + sentence_order
    labelled = bert_labelled_positions(config) if labelled_positions is None else labelled_positions
    sample_flops = seq * layers * _transformer_block_flops(hidden, ffn, seq)
    sample_flops += labelled * (2 * hidden * hidden + 2 * hidden * vocab)
    if pairs:
        sample_flops += 2 * hidden * hidden + 4 * hidden
    return ModelCounts(
        total_params=total, embedding_params=embedding, flops_per_token=3.0 * sample_flops / seq,
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + (m/s)·(2h² + 2h·V) [+ (2h² + 4h)/s with NSP/SOP]) with m the "
                      "labelled positions per sample (Kaplan et al. 2020, table 1)",
    )


def t5_counts(config: Config) -> ModelCounts:
    """Kaplan et al. 2020's per-operation counts (table 1) over T5's two stacks (Raffel et al. 2020,
    sec. 3.2.2: encoder over the inputs, decoder over the targets): encoder layers over s_e =
    model.seq_length tokens, decoder layers over the objective's s_d targets, each with self- and
    cross-attention; every decoder layer projects the s_e encoder outputs to keys and values, and
    the output layer (tied or not) computes logits at the s_d decoder positions. FLOPs per token
    divide by s_e. Attention width i = heads · head_dim may differ from h; g = 2 for gated-GELU."""
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
    decoder_flops = decoder_layers * (decoder_length * decoder_token + encoder_length * 2 * 2 * hidden * inner)
    head_flops = decoder_length * 2 * hidden * vocab
    return ModelCounts(
        total_params=total, embedding_params=vocab * hidden + relative_tables,
        flops_per_token=3.0 * (encoder_flops + decoder_flops + head_flops) / encoder_length,
        flops_formula="3·(s_e·L_e·(8h·i + 2(g+1)h·f + 4i·s_e) + L_d·(s_d·(12h·i + 2(g+1)h·f + 4i·(s_d + s_e)) "
                      "+ 4h·i·s_e) + 2h·V·s_d) / s_e (Kaplan et al. 2020, table 1, per stack)",
    )


def t5_decoder_length(config: Config) -> int:
    """Targets per sample: T5's span-corruption target length (sec. 3.1.4), or the full sequence for prefix LM."""
    objective = config.objective
    if objective.resolved_kind(config.model.family) == "prefix_lm":
        return config.model.seq_length
    return random_spans_helper(config.model.seq_length, objective.noise_density, objective.mean_noise_span_length)[1]


FAMILY_COUNTS: dict[str, Callable[[Config], ModelCounts]] = {"gpt": gpt_counts, "bert": bert_counts, "t5": t5_counts}
