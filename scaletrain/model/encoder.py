"""What the masked-LM encoder families share (bert, albert; electra's generator and discriminator use
its embedding and decoder): word + position + segment embeddings, the MLM head (transform, tied decoder,
output bias), the sentence-order and span boundary heads, the layer runners, the loss and the `BERT`
forward with its masked-token accuracy, and the `objective:` sections that mask tokens (MaskingObjective,
ELECTRA's; MaskedLMObjective, BERT's and ALBERT's). A family adds its config, its blocks and its counts
(families/bert/model.py, families/albert/model.py, families/electra/model.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch import nn

from scaletrain.batch import IGNORE_INDEX, Batch
from scaletrain.config import Config, ConfigError, ObjectiveConfig, bounded
from scaletrain.data.masking import SPAN_BOUNDARY_KEYS, masking_budget
from scaletrain.model.family import LayeredModel
from scaletrain.model.init import normal_init
from scaletrain.model.layers import (
    TransformerBlock,
    gelu_erf,
    key_padding_attention_mask,
    masked_vocab_parallel_loss,
    parallel_lm_logits,
    vocab_parallel_argmax,
)
from scaletrain.model.parallel_config import model_parallel_config


@dataclass
class MaskingObjective(ObjectiveConfig):
    """Which tokens an encoder's objective masks (data/masking.py): ELECTRA's `objective:` section, whose
    generator predicts them (Clark et al. 2020, sec. 2)."""

    # fraction of non-special tokens masked (Devlin et al. 2019, sec. 3.1)
    mask_prob: float = bounded(0.15, "(0, 1)", "BERT: 0.15")
    whole_word_masking: bool = False  # mask all pieces of a word together
    span_masking: bool = False  # SpanBERT's geometric spans (Joshi et al. 2020, sec. 3.1)


@dataclass
class MaskedLMObjective(MaskingObjective):
    """BERT's and ALBERT's `objective:` section: the masked LM, with sentence pairs and SpanBERT's span boundary
    objective as options."""

    # SpanBERT's span boundary objective (Joshi et al. 2020, sec. 3.2): also predict each masked token from
    # the two tokens around its span and its place in it (SpanBoundaryHead, below); needs span_masking
    span_boundary: bool = False
    sentence_pairs: str = "none"  # none (RoBERTa-style packing) | nsp (BERT) | sop (ALBERT)

    @property
    def reads_sentence_pairs(self) -> bool:
        return self.sentence_pairs != "none"

    def validate(self) -> None:
        if self.sentence_pairs not in ("none", "nsp", "sop"):
            raise ConfigError(f"objective.sentence_pairs={self.sentence_pairs!r}; use none, nsp or sop")
        if self.span_boundary and not self.span_masking:
            raise ConfigError("objective.span_boundary=true predicts masked spans from their boundaries, but "
                              "objective.span_masking=false masks single tokens; set objective.span_masking=true "
                              "(SpanBERT) or objective.span_boundary=false")


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
        if config.objective.reads_sentence_pairs:
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


# Activations: (hidden, padding_mask, *span boundaries) through the blocks, the span boundaries
# (SPAN_BOUNDARY_KEYS) only with the span boundary head and when given. The heads see the MLM labels
# only when the model runs on one device (`labels` in the context), and then run on labelled positions
# only (~15% of tokens), as BERT's run_pretraining.py gathers masked positions first. The heads' outputs
# are (MLM, sentence order if the model has its head, span boundary if given its inputs): `split_head_outputs`.


def run_embedding(embedding: BertEmbedding, activations: tuple, **_) -> tuple:
    tokens, token_types, padding_mask, *span_boundaries = activations
    return embedding(tokens, token_types), padding_mask, *span_boundaries


def run_block(block: TransformerBlock, activations: tuple, **_) -> tuple:
    hidden, padding_mask, *span_boundaries = activations
    return block(hidden, key_padding_attention_mask(padding_mask)), padding_mask, *span_boundaries


def run_final_norm(norm: nn.Module, activations: tuple, **_) -> tuple:
    hidden, _padding_mask, *span_boundaries = activations
    return norm(hidden), *span_boundaries


def run_heads(heads: BertHeads, activations: tuple, labels: torch.Tensor | None = None, **_) -> tuple:
    hidden, *span_boundaries = activations
    selected = None if labels is None else labels.transpose(0, 1) != IGNORE_INDEX
    outputs = [heads.transform(hidden if selected is None else hidden[selected])]
    if heads.sentence_order_head is not None:
        outputs.append(heads.sentence_order_logits(hidden))
    if heads.span_boundary_head is not None and span_boundaries:
        outputs.append(heads.span_boundary(hidden, *span_boundaries, selected))
    return tuple(outputs)


def split_head_outputs(outputs: tuple, sentence_order: bool) -> tuple[torch.Tensor, tuple, tuple]:
    """(MLM, (sentence order,) or (), (span boundary,) or ()) of the heads' outputs, before or after the decoder."""
    return outputs[0], outputs[1:1 + sentence_order], outputs[1 + sentence_order:]


def run_tied_decoder(embedding: BertEmbedding, activations: tuple, sentence_order: bool = False, **_) -> tuple:
    """The tied decoder, for the MLM head and (SpanBERT's code ties it too) the span boundary head."""
    masked_lm, sentence_order_logits, span_boundary = split_head_outputs(activations, sentence_order)
    weight = embedding.word.weight
    return (parallel_lm_logits(masked_lm, weight), *sentence_order_logits,
            *(parallel_lm_logits(transformed, weight) for transformed in span_boundary))


def run_decoder_bias(bias: DecoderBias, activations: tuple, **_) -> tuple:
    logits, *rest = activations
    return logits + bias.bias, *rest


def run_span_boundary_decoder_bias(bias: SpanBoundaryDecoderBias, activations: tuple, sentence_order: bool = False,
                                **_) -> tuple:
    masked_lm, sentence_order_logits, span_boundary = split_head_outputs(activations, sentence_order)
    return masked_lm, *sentence_order_logits, *(logits + bias.decoder_bias for logits in span_boundary)


def mlm_loss(outputs: tuple, labels: tuple) -> torch.Tensor:
    """Masked-LM mean over labelled tokens, plus the sentence-order cross-entropy when present
    (BERT sums its two pre-training losses), plus the span boundary mean over the same tokens when
    the heads gave it (SpanBERT sums MLM and SBO per masked token, sec. 3.2; its code takes the two
    means, `lm_loss / ntokens + pair_loss / npairs`, and here every masked token is an SBO target).
    A pipeline always has the sentence-order labels when the model has that head."""
    masked_lm, sentence_order_logits, span_boundary = split_head_outputs(outputs, sentence_order=len(labels) > 1)
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
        masked_lm, sentence_order_logits, span_boundary = split_head_outputs(outputs, self.has_sentence_order_head)
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
    special = 3 if config.objective.reads_sentence_pairs else 2
    return masking_budget(config.model.seq_length - special, config.objective.mask_prob)
