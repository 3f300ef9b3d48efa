"""BERT encoder (Devlin et al. 2019): word + position + segment embeddings, post-LN blocks (pre-LN
selectable), the masked-LM head tied to the word embedding, an optional sentence-order head and
SpanBERT's optional span boundary head (Joshi et al. 2020, sec. 3.2)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch import nn

from scaletrain.batch import IGNORE_INDEX, Batch, BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig
from scaletrain.data.masking import SPAN_BOUNDARY_KEYS, masking_budget
from scaletrain.model.chunked_cross_entropy import refuse_loss_chunking
from scaletrain.model.counts import ModelCounts, transformer_block_flops
from scaletrain.model.family import LayeredModel, PipelineLayer
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import (
    ParallelAttention,
    ParallelMLP,
    TransformerBlock,
    gelu_erf,
    key_padding_attention_mask,
    masked_vocab_parallel_loss,
    parallel_lm_logits,
    vocab_parallel_argmax,
)
from scaletrain.model.parallel_config import model_parallel_config

LAYERNORM_POSITIONS = ("post", "pre")


@dataclass
class BertConfig(ModelConfig):
    layernorm_position: str = "post"  # post (BERT) | pre (GPT-2 style, with a final LayerNorm)
    type_vocab_size: int = 2  # segment embeddings


class BertEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position + token-type (segment) embeddings, then LayerNorm
    (Devlin et al. 2019, sec. 3.2 and fig. 2); output [seq, batch, size]. `size` is the hidden size,
    or the smaller factorized embedding size that ALBERT (Lan et al. 2020, sec. 3.1) and
    ELECTRA project to the hidden size."""

    def __init__(self, config: Config, size: int | None = None) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        size = size or model.hidden_size
        self.word = tensor_parallel.VocabParallelEmbedding(
            config.padded_vocab_size, size,
            init_method=normal_init(model.init_std, seed, "embedding.word"), config=model_parallel_config(config),
        )
        self.position = nn.Embedding(model.seq_length, size)
        self.token_type = nn.Embedding(model.type_vocab_size, size)
        with torch.no_grad():
            normal_init(model.init_std, seed, "embedding.position")(self.position.weight)
            normal_init(model.init_std, seed, "embedding.token_type")(self.token_type.weight)
        self.norm = nn.LayerNorm(size, eps=model.layernorm_eps)
        self.dropout = nn.Dropout(model.dropout)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        embedded = self.word(tokens) + self.position(positions) + self.token_type(token_types)
        return self.dropout(self.norm(embedded).transpose(0, 1).contiguous())


class BertHeads(nn.Module):
    """BERT's `cls/predictions` transform (dense + GELU + LayerNorm) and, with sentence pairs, the
    pooler + 2-way classifier of next-sentence (Devlin et al. 2019, sec. 3.1) or sentence-order
    prediction (Lan et al. 2020, sec. 4.2; label 0: segment B follows A).

    The transform is replicated on every TP rank, as Megatron's BertLMHead does: it is small next
    to the decoder, and its replicated output is exactly the input the vocab-split decoder takes.
    The decoder is the tied word embedding and its bias a layer of its own (`lm_head.bias`). With
    objective.span_boundary, SpanBERT's span boundary head (`SpanBoundaryHead`) sits beside them.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        hidden, std = model.hidden_size, model.init_std
        self.lm_head = nn.Module()
        self.lm_head.dense = replicated_linear(hidden, hidden, std, seed, "lm_head.dense")
        self.lm_head.norm = nn.LayerNorm(hidden, eps=model.layernorm_eps)
        self.sentence_order_head = None
        if config.objective.sentence_pairs != "none":
            self.sentence_order_head = nn.Module()
            self.sentence_order_head.pooler = replicated_linear(hidden, hidden, std, seed, "sentence_order_head.pooler")
            self.sentence_order_head.classifier = replicated_linear(
                hidden, 2, std, seed, "sentence_order_head.classifier"
            )
        self.span_boundary_head = SpanBoundaryHead(config) if config.objective.span_boundary else None

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.norm(gelu_erf(self.lm_head.dense(hidden)))

    def sentence_order_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.sentence_order_head
        return head.classifier(torch.tanh(head.pooler(hidden[0])))  # [CLS] position -> [batch, 2]

    def span_boundary(self, hidden: torch.Tensor, left: torch.Tensor, right: torch.Tensor, position: torch.Tensor,
                      selected: torch.Tensor | None) -> torch.Tensor:
        """The span boundary head's y_i at every position of hidden [seq, batch, h] (the pipeline's
        last stage) or at the `selected` [seq, batch] ones (as `transform` is run); left, right and
        position are the collator's [batch, seq] (data/masking.py span_boundaries)."""
        left, right, position = left.transpose(0, 1), right.transpose(0, 1), position.transpose(0, 1)
        batch_index = torch.arange(hidden.shape[1], device=hidden.device).expand_as(left)
        if selected is not None:
            left, right, position, batch_index = (part[selected] for part in (left, right, position, batch_index))
        return self.span_boundary_head(hidden[left, batch_index], hidden[right, batch_index], position)


class SpanBoundaryHead(nn.Module):
    """SpanBERT's span boundary objective (Joshi et al. 2020, sec. 3.2, eq. 1): a masked token x_i of
    the span (s..e) is predicted from the encoder's outputs at the span's boundaries and a learned
    embedding of its relative position, y_i = f(x_{s-1}, x_{e+1}, p_{i-s+1}), with
    h0 = [x_{s-1}; x_{e+1}; p], h1 = LayerNorm(GeLU(W1 h0)), y_i = LayerNorm(GeLU(W2 h1)).
    y_i then goes through the tied decoder (the word embedding) with an output bias of its own, as
    SpanBERT's code does (`BertPairTargetPredictionHead` in pretraining/fairseq/models/pair_bert.py:
    `self.decoder.weight = bert_model_embedding_weights`, `self.bias`); that bias is the
    `span_boundary_head` layer after the decoder.

    p is hidden_size wide (SpanBERT's code uses 200 at every size; the paper leaves it open). The
    table has a row per place a masked run can have: the masking budget of a sequence bounds the
    run's length (`labelled_positions`), so every masked token is a target. SpanBERT's code
    instead cuts its merged runs at 15 tokens (--max-pair-targets) and leaves the rest to MLM alone.
    Replicated on every TP rank like the MLM transform; training-only (the HF export drops it).
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        hidden, std = model.hidden_size, model.init_std
        self.position_embedding = nn.Embedding(labelled_positions(config), hidden)
        with torch.no_grad():
            normal_init(std, seed, "span_boundary_head.position_embedding")(self.position_embedding.weight)
        self.dense_in = replicated_linear(3 * hidden, hidden, std, seed, "span_boundary_head.dense_in")
        self.norm_in = nn.LayerNorm(hidden, eps=model.layernorm_eps)
        self.dense_out = replicated_linear(hidden, hidden, std, seed, "span_boundary_head.dense_out")
        self.norm_out = nn.LayerNorm(hidden, eps=model.layernorm_eps)

    def forward(self, left: torch.Tensor, right: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """left, right [..., h]; position [...], 1-based (0, at positions that are not masked, reads row 0)."""
        relative = self.position_embedding((position - 1).clamp(min=0))
        inner = self.norm_in(gelu_erf(self.dense_in(torch.cat([left, right, relative], dim=-1))))
        return self.norm_out(gelu_erf(self.dense_out(inner)))


class DecoderBias(nn.Module):
    """The MLM decoder's output bias, split like the decoder's vocabulary rows (partition_dim 0)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size // config.parallel.tensor))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)


class SpanBoundaryDecoderBias(nn.Module):
    """The span boundary head's own output bias (SpanBERT's), split like the decoder's vocabulary rows."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.decoder_bias = nn.Parameter(torch.zeros(config.padded_vocab_size // config.parallel.tensor))
        tensor_parallel.set_tensor_model_parallel_attributes(self.decoder_bias, is_parallel=True, dim=0, stride=1)


def replicated_linear(in_features: int, out_features: int, std: float, seed: int, name: str) -> nn.Linear:
    """nn.Linear copied on every TP rank: normal(std) weight keyed by name, zero bias (BERT's init)."""
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        normal_init(std, seed, name)(linear.weight)
        linear.bias.zero_()
    return linear


def build_block(config: Config, layer: int) -> TransformerBlock:
    """BERT initialises every weight with std 0.02 (Devlin et al. 2019, HF's initializer_range).
    A pre-LN stack's residual stream grows with depth, so there the output projections take
    GPT-2's 1/sqrt(2 * layers) scaling (Radford et al. 2019, sec. 2.3); post-LN renormalises it."""
    model, seed = config.model, config.train.seed
    pre_norm = model.layernorm_position == "pre"
    output_std = residual_std(model.init_std, model.num_layers) if pre_norm else model.init_std

    def init(sublayer: str):
        return lambda part: normal_init(
            output_std if part in ("output", "proj") else model.init_std, seed, f"blocks.{layer}.{sublayer}.{part}"
        )

    mp_config = model_parallel_config(config)
    attention = ParallelAttention(model.hidden_size, model.num_heads, mp_config, init("attention"),
                                  dropout=model.dropout, layer_index=layer)
    mlp = ParallelMLP(model.hidden_size, model.ffn_size, mp_config, init("mlp"), activation=gelu_erf)
    return TransformerBlock(attention, mlp, lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps),
                            pre_norm=pre_norm, dropout=model.dropout)


# Activations: (hidden, padding_mask, *span boundaries) through the blocks, the span boundaries
# (SPAN_BOUNDARY_KEYS) only with the span boundary head and when given. The heads see the MLM labels
# only when the model runs on one device (`labels` in the context), and then run on labelled positions
# only (~15% of tokens), as BERT's run_pretraining.py gathers masked positions first. The heads' outputs
# are (MLM, sentence order if the model has its head, span boundary if given its inputs): `_split`.


def _embed(embedding: BertEmbedding, activations: tuple, **_) -> tuple:
    tokens, token_types, padding_mask, *span_boundaries = activations
    return embedding(tokens, token_types), padding_mask, *span_boundaries


def _block(block: TransformerBlock, activations: tuple, **_) -> tuple:
    hidden, padding_mask, *span_boundaries = activations
    return block(hidden, key_padding_attention_mask(padding_mask)), padding_mask, *span_boundaries


def _final_norm(norm: nn.Module, activations: tuple, **_) -> tuple:
    hidden, _padding_mask, *span_boundaries = activations
    return norm(hidden), *span_boundaries


def _heads(heads: BertHeads, activations: tuple, labels: torch.Tensor | None = None, **_) -> tuple:
    hidden, *span_boundaries = activations
    selected = None if labels is None else labels.transpose(0, 1) != IGNORE_INDEX
    outputs = [heads.transform(hidden if selected is None else hidden[selected])]
    if heads.sentence_order_head is not None:
        outputs.append(heads.sentence_order_logits(hidden))
    if heads.span_boundary_head is not None and span_boundaries:
        outputs.append(heads.span_boundary(hidden, *span_boundaries, selected))
    return tuple(outputs)


def _split(outputs: tuple, sentence_order: bool) -> tuple[torch.Tensor, tuple, tuple]:
    """(MLM, (sentence order,) or (), (span boundary,) or ()) of the heads' outputs, before or after the decoder."""
    return outputs[0], outputs[1:1 + sentence_order], outputs[1 + sentence_order:]


def _decoder(embedding: BertEmbedding, activations: tuple, sentence_order: bool = False, **_) -> tuple:
    """The tied decoder, for the MLM head and (SpanBERT's code ties it too) the span boundary head."""
    masked_lm, sentence_order_logits, span_boundary = _split(activations, sentence_order)
    weight = embedding.word.weight
    return (parallel_lm_logits(masked_lm, weight), *sentence_order_logits,
            *(parallel_lm_logits(transformed, weight) for transformed in span_boundary))


def _decoder_bias(bias: DecoderBias, activations: tuple, **_) -> tuple:
    logits, *rest = activations
    return logits + bias.bias, *rest


def _span_boundary_decoder_bias(bias: SpanBoundaryDecoderBias, activations: tuple, sentence_order: bool = False,
                                **_) -> tuple:
    masked_lm, sentence_order_logits, span_boundary = _split(activations, sentence_order)
    return masked_lm, *sentence_order_logits, *(logits + bias.decoder_bias for logits in span_boundary)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model
    pre_norm = model.layernorm_position == "pre"
    sentence_order = config.objective.sentence_pairs != "none"
    span_boundary = [PipelineLayer("span_boundary_head", lambda: SpanBoundaryDecoderBias(config),
                                   functools.partial(_span_boundary_decoder_bias, sentence_order=sentence_order))]
    return [
        PipelineLayer("embedding", lambda: BertEmbedding(config), _embed),
        *(PipelineLayer(f"blocks.{layer}", lambda layer=layer: build_block(config, layer), _block, is_block=True)
          for layer in range(model.num_layers)),
        PipelineLayer(
            "final_norm",
            lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps) if pre_norm else nn.Identity(),
            _final_norm,
        ),
        PipelineLayer("", lambda: BertHeads(config), _heads),
        PipelineLayer("decoder", lambda: BertEmbedding(config),
                      functools.partial(_decoder, sentence_order=sentence_order), tied_to="embedding",
                      tied_weight="word.weight"),
        PipelineLayer("lm_head", lambda: DecoderBias(config), _decoder_bias),
        *(span_boundary if config.objective.span_boundary else []),
    ]


def mlm_loss(outputs: tuple, labels: tuple) -> torch.Tensor:
    """Masked-LM mean over labelled tokens, plus the sentence-order cross-entropy when present
    (BERT sums its two pre-training losses), plus the span boundary mean over the same tokens when
    the heads gave it (SpanBERT sums MLM and SBO per masked token, sec. 3.2; its code takes the two
    means, `lm_loss / ntokens + pair_loss / npairs`, and here every masked token is an SBO target).
    A pipeline always has the sentence-order labels when the model has that head."""
    masked_lm, sentence_order_logits, span_boundary = _split(outputs, sentence_order=len(labels) > 1)
    loss = masked_vocab_parallel_loss(masked_lm, labels[0])
    if sentence_order_logits:
        loss = loss + F.cross_entropy(sentence_order_logits[0].float(), labels[1])
    for logits in span_boundary:
        loss = loss + masked_vocab_parallel_loss(logits, labels[0])
    return loss


class BERT(LayeredModel):
    @property
    def has_sentence_order_head(self) -> bool:
        return self._modules.get("sentence_order_head") is not None

    @property
    def has_span_boundary_head(self) -> bool:
        return self._modules.get("span_boundary_head") is not None

    def forward(
        self,
        tokens: torch.Tensor,
        token_types: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        sentence_order_labels: torch.Tensor | None = None,
        left_boundary: torch.Tensor | None = None,
        right_boundary: torch.Tensor | None = None,
        span_position: torch.Tensor | None = None,
        masked_accuracy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens, token_types, padding_mask (1 = real token), labels (-100 = not predicted): [batch, seq];
        sentence_order_labels: [batch]; left_boundary, right_boundary, span_position: [batch, seq], the
        span boundary head's inputs (data/masking.py span_boundaries). The loss if labels are given, else
        vocab-parallel logits [batch, seq, vocab / TP]; with masked_accuracy, `masked_token_accuracy`'s
        counts. Everything runs through forward, so ZeRO-3 gathers the tied decoder weight it has
        registered here."""
        if sentence_order_labels is not None and not self.has_sentence_order_head:
            raise ValueError(
                "sentence_order_labels were given but this BERT has no sentence-order head; "
                "set objective.sentence_pairs to nsp or sop, or drop the labels"
            )
        span_boundaries = _span_boundaries(self.has_span_boundary_head, left_boundary, right_boundary, span_position)
        if labels is not None and not masked_accuracy and self.has_span_boundary_head and not span_boundaries:
            raise ValueError("this BERT has the span boundary head (objective.span_boundary), so its loss needs "
                             f"{', '.join(SPAN_BOUNDARY_KEYS)} from the MLM collator with span_boundary=True")
        inputs = (*_inputs(tokens, token_types, padding_mask), *span_boundaries)
        outputs = self.run_layers(inputs, labels=labels)
        if labels is None:
            return outputs[0].transpose(0, 1)
        targets = labels.transpose(0, 1)[labels.transpose(0, 1) != IGNORE_INDEX]
        if masked_accuracy:
            return _masked_accuracy_counts(outputs[0], targets)
        masked_lm, sentence_order_logits, span_boundary = _split(outputs, self.has_sentence_order_head)
        loss = _mean_cross_entropy(masked_lm, targets)
        if sentence_order_labels is not None:
            loss = loss + F.cross_entropy(sentence_order_logits[0].float(), sentence_order_labels)
        for logits in span_boundary:
            loss = loss + _mean_cross_entropy(logits, targets)
        return loss

    def sentence_order_logits(
        self, tokens: torch.Tensor, token_types: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[batch, 2] logits of the sentence-order head (label 0: in order)."""
        if not self.has_sentence_order_head:
            raise ValueError("this BERT has no sentence-order head; set objective.sentence_pairs to nsp or sop")
        return self.run_layers(_inputs(tokens, token_types, padding_mask))[1]

    @torch.no_grad()
    def masked_token_accuracy(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        token_types: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        **_,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct, labelled) counts of labelled positions whose full-vocabulary argmax is the label.
        Counts rather than a ratio, so validation can sum them over batches and data-parallel ranks."""
        return self(tokens, token_types, padding_mask, labels=labels, masked_accuracy=True)


def _mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of vocab-parallel logits [labelled, vocab / TP] against their targets."""
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets).sum() / max(targets.numel(), 1)


def _span_boundaries(has_head: bool, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The span boundary head's inputs if all are given (() if none), refused without the head."""
    given = [tensor is not None for tensor in tensors]
    if any(given) and not (all(given) and has_head):
        raise ValueError(f"{', '.join(SPAN_BOUNDARY_KEYS)} go together, to a BERT with the span boundary head; "
                         "set objective.span_boundary=true (with span_masking) or drop them")
    return tuple(tensors) if all(given) else ()


def _inputs(tokens: torch.Tensor, token_types: torch.Tensor | None, padding_mask: torch.Tensor | None) -> tuple:
    token_types = torch.zeros_like(tokens) if token_types is None else token_types
    padding_mask = torch.ones_like(tokens) if padding_mask is None else padding_mask
    return tokens, token_types, padding_mask


def build(config: Config) -> BERT:
    return BERT(pipeline_layers(config), config.train.full_recompute_interval)


def evaluation_counts(model: BERT, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Validation accuracy of the masked tokens (Devlin et al. 2019 report it too)."""
    return {"val_masked_accuracy": model.masked_token_accuracy(**batch)}


def pipeline_evaluation_counts(outputs: tuple, labels: tuple) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """evaluation_counts from a pipeline's last stage, which holds the logits of every position
    [seq, batch, vocab / TP] (its heads see no labels to select with) and the labels [batch, seq]."""
    targets = labels[0].transpose(0, 1)
    labelled = targets != IGNORE_INDEX
    return {"val_masked_accuracy": _masked_accuracy_counts(outputs[0][labelled], targets[labelled])}


def _masked_accuracy_counts(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, labelled) of vocab-parallel logits [labelled, vocab / TP] against their targets."""
    predictions = vocab_parallel_argmax(logits.detach())
    return (predictions == targets).sum(), torch.tensor(targets.numel(), device=targets.device)


def labelled_positions(config: Config) -> int:
    """Positions per sample the MLM head runs on: the collator's budget round(mask_prob · n) of the
    n non-special tokens (data/masking.py), n = seq_length - 2 for packed `[CLS] text [SEP]`, - 3 for
    `[CLS] A [SEP] B [SEP]` pairs. Exact for a sample without document boundaries; an eos between
    documents, a padded short pair or a whole word that no longer fits the budget make it fewer."""
    special = 3 if config.objective.sentence_pairs != "none" else 2
    return masking_budget(config.model.seq_length - special, config.objective.mask_prob)


def counts(config: Config, labelled: float | None = None) -> ModelCounts:
    """BERT's encoder blocks as GPT's (Kaplan et al. 2020, table 1, without the causal mask); the MLM
    head (transform 2h² + decoder 2h·V) runs only at labelled positions (`labelled_positions`, or
    `labelled` per sample of one batch), the sentence-order head (pooler 2h² + classifier 4h)
    once per sample, and the span boundary head (W1 on [x_{s-1}; x_{e+1}; p] 6h², W2 2h², decoder 2h·V)
    at the labelled positions too; its relative-position table is a lookup table (embedding)."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, ffn, layers, seq = model.hidden_size, model.ffn_size, model.num_layers, model.seq_length
    pairs = config.objective.sentence_pairs != "none"
    block = 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn  # QKV, output, fc, proj (+ biases), 2 LNs
    embedding = (vocab + seq + model.type_vocab_size) * hidden
    final_norm = 2 * hidden if model.layernorm_position == "pre" else 0
    head = hidden * hidden + 3 * hidden + vocab  # transform dense + bias, LayerNorm, decoder bias
    sentence_order = hidden * hidden + hidden + 2 * hidden + 2 if pairs else 0
    span_boundary = config.objective.span_boundary
    if span_boundary:
        embedding += labelled_positions(config) * hidden  # relative positions 1..the longest masked run
    # W1 [3h -> h] and W2 + biases, two LayerNorms, its own decoder bias
    span_boundary_head = 4 * hidden * hidden + 6 * hidden + vocab if span_boundary else 0
    total = embedding + 2 * hidden + layers * block + final_norm + head + sentence_order + span_boundary_head
    labelled = labelled_positions(config) if labelled is None else labelled
    sample_flops = seq * layers * transformer_block_flops(hidden, ffn, seq)
    sample_flops += labelled * (2 * hidden * hidden + 2 * hidden * vocab)
    if pairs:
        sample_flops += 2 * hidden * hidden + 4 * hidden
    if span_boundary:
        sample_flops += labelled * (8 * hidden * hidden + 2 * hidden * vocab)
    return ModelCounts(
        total_params=total, embedding_params=embedding, flops_per_token=3.0 * sample_flops / seq,
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + (m/s)·(2h² + 2h·V) [+ (2h² + 4h)/s with NSP/SOP] "
                      "[+ (m/s)·(8h² + 2h·V) with SBO]) with m the labelled positions per sample "
                      "(Kaplan et al. 2020, table 1)",
    )


def validate(config: Config) -> None:
    refuse_loss_chunking(config, "its masked-LM logits are made at the masked positions only (about 15% of the "
                                 "tokens) and take a bias after the output layer")
    model = config.model
    if model.layernorm_position not in LAYERNORM_POSITIONS:
        raise ConfigError(f"model.layernorm_position={model.layernorm_position!r}; use post (BERT) or pre")
    minimum_types = 2 if config.objective.sentence_pairs != "none" else 1
    if model.type_vocab_size < minimum_types:
        raise ConfigError(
            f"model.type_vocab_size={model.type_vocab_size}; sentence pairs need segment ids 0 and 1, "
            f"so use >= {minimum_types}"
        )


def batch_schema(config: Config) -> BatchSchema:
    span_boundaries = SPAN_BOUNDARY_KEYS if config.objective.span_boundary else ()
    return BatchSchema(inputs=("tokens", "token_types", "padding_mask", *span_boundaries), labels=("labels",),
                       optional_labels=("sentence_order_labels",))
