"""What every causal decoder family shares (gpt, llama): the `DecoderConfig` keys of packed documents,
sliding windows, the attention backend and mixture-of-experts MLPs; the block runner (masks, positions
restarted per document, ring attention under context parallelism); the final norm; the next-token loss
and the `DecoderLM` forward, with its KV cache. A family adds its embedding, its blocks and its counts
(families/gpt/model.py, families/llama/model.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.batch import DOCUMENT_IDS, BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig, bounded
from scaletrain.model.attention_masks import (
    DocumentAttention,
    SharedBlockMask,
    decoder_attention_mask,
    positions_in_document,
    visible_keys,
)
from scaletrain.model.chunked_cross_entropy import DeferredLogits, as_logits
from scaletrain.model.family import LayeredModel
from scaletrain.model.layers import KVCache, TransformerBlock, full_sequence_length, masked_vocab_parallel_loss_sum
from scaletrain.model.moe import MoEConfig, validate_moe
from scaletrain.parallel.context_parallel import (
    RingMask,
    context_parallel_size,
    context_parallel_token_mean,
    local_positions,
    local_tokens,
)
from scaletrain.parallel.sequence_parallel import mark_sequence_parallel

DECODER_BATCH = BatchSchema(inputs=("tokens",), labels=("labels",), optional_inputs=("prefix_lengths",))


@dataclass
class DecoderConfig(ModelConfig):
    """The keys of every causal decoder (gpt, llama): what limits attention in a packed sequence, and
    mixture-of-experts MLPs (GELU experts for gpt, Switch-style with top_k 1; SwiGLU for llama, Mixtral)."""

    # attend only within one's own document of the packed sequence (a document begins at the eos that
    # separates it from the one before; model/attention_masks.py)
    document_masking: bool = False
    # positions restart at 0 at each document of the packed sequence (learned for gpt, rotary for llama), so a
    # packed document sees the positions it would see alone (rotary attention within a document is relative,
    # so with document_masking it changes nothing for llama)
    document_positions: bool = False
    # sliding-window attention (Beltagy et al. 2020; Mistral, Jiang et al. 2023): a query sees itself and the
    # sliding_window - 1 tokens before it, and generation caches as many keys per layer; null: no window
    sliding_window: int | None = bounded(None, ">= 1", "the query itself; or null for full causal attention")
    # how a masked training forward (documents, window, prefix LM) attends: sdpa with a boolean [b, s, s] mask;
    # flex, FlexAttention with a block mask that skips the tiles nobody sees (CUDA to train; no attention dropout,
    # no context parallelism); auto: flex where it can run, else sdpa (`attention_backend`)
    attention_backend: str = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts MLPs (model/moe.py)

    @property
    def document_attention(self) -> DocumentAttention:
        return DocumentAttention(masking=self.document_masking, positions=self.document_positions)


def decoder_batch(config: Config) -> BatchSchema:
    """Tokens and labels, a prefix LM's prefix_lengths, and the document ids when the model reads them."""
    if not config.model.document_attention.reads_document_ids:
        return DECODER_BATCH
    return BatchSchema(inputs=DECODER_BATCH.inputs, labels=DECODER_BATCH.labels,
                       optional_inputs=(*DECODER_BATCH.optional_inputs, DOCUMENT_IDS))


def sequence_parallel_region(config: Config, module: nn.Module) -> nn.Module:
    """Under sequence parallelism a block's (and the final norm's) replicated parameters see one
    sequence slice per TP rank: mark them, so their gradients are summed over TP ranks."""
    if config.parallel.sequence_parallel:
        mark_sequence_parallel(module)
    return module


# Activations between layers: (hidden [seq, batch, h], *extras), the extras what the batch carried beside
# the tokens: a prefix LM's prefix_lengths [batch], the document ids [batch, seq], or both. They travel
# with the hidden state through every pipeline stage (as integers, model/pipeline.py), so each block
# builds its mask and positions from them; their shapes tell them apart.

NO_DOCUMENTS = DocumentAttention()
ATTENTION_BACKENDS = ("sdpa", "flex", "auto")


def attention_backend(config: Config) -> str:
    """model.attention_backend resolved once, when the model is built: auto is flex on a CUDA machine without
    attention dropout or context parallelism (the cases validate_decoder refuses for flex), else sdpa."""
    requested = config.model.attention_backend
    if requested != "auto":
        return requested
    flex_runs = torch.cuda.is_available() and config.model.dropout == 0 and config.parallel.context == 1
    return "flex" if flex_runs else "sdpa"


def decoder_extras(extras: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(prefix_lengths [batch], document_ids [batch, seq]) from what travels beside the hidden state."""
    prefix_lengths = next((extra for extra in extras if extra.dim() == 1), None)
    document_ids = next((extra for extra in extras if extra.dim() == 2), None)
    return prefix_lengths, document_ids


def run_decoder_block(block: TransformerBlock, activations: tuple, cache: KVCache | None = None,
                      documents: DocumentAttention = NO_DOCUMENTS, rotary: bool = False,
                      block_mask: SharedBlockMask | None = None, **_) -> tuple:
    """A causal block on (hidden, *extras); shared by every decoder family. `documents` says whether the
    document ids mask attention; `rotary` that the block takes positions restarted per document from them
    (a family with learned positions adds those in its embedding instead). With `block_mask` (the flex
    backend) a full-sequence forward attends through the micro-batch's one FlexAttention block mask; decoding
    behind a KV cache keeps SDPA. Under context parallelism the hidden state is this rank's chunks and
    attention runs round the ring (parallel/context_parallel.py)."""
    hidden, *rest = activations
    prefix_lengths, document_ids = decoder_extras(rest)
    positions = None
    if rotary and documents.positions and document_ids is not None:
        positions = local_tokens(positions_in_document(document_ids))
    if context_parallel_size() > 1:
        ring = _ring_mask(block, hidden, prefix_lengths, document_ids if documents.masking else None)
        return (block(hidden, positions=positions, ring=ring), *rest)
    seq_length = full_sequence_length(hidden, block.attention.sequence_parallel)
    document_ids = document_ids if documents.masking else None
    if block_mask is not None and cache is None:
        mask = block_mask.get(seq_length, hidden.device, prefix_lengths, document_ids)
    else:
        mask = decoder_attention_mask(seq_length, hidden.device, prefix_lengths, document_ids)
    return (block(hidden, mask, cache=cache, positions=positions), *rest)


def _ring_mask(block: TransformerBlock, hidden: torch.Tensor, prefix_lengths: torch.Tensor | None,
               document_ids: torch.Tensor | None) -> RingMask:
    """This rank's global positions, and the causal / prefix / document / window limits by global position."""
    seq_length = hidden.shape[0] * context_parallel_size()
    visible = functools.partial(visible_keys, prefix_lengths=prefix_lengths, document_ids=document_ids,
                                window=block.attention.sliding_window)
    return RingMask(local_positions(seq_length, hidden.device), visible)


def run_final_norm(norm: nn.Module, activations: tuple, **_) -> tuple:
    """The final norm on the hidden state; whatever travelled beside it (masks) ends here."""
    return (norm(activations[0]),)


def decoder_block_runner(config: Config, rotary: bool = False) -> functools.partial:
    """run_decoder_block for this model's blocks, which share one SharedBlockMask under the flex backend."""
    model = config.model
    shared = SharedBlockMask(model.sliding_window) if attention_backend(config) == "flex" else None
    return functools.partial(run_decoder_block, documents=model.document_attention, rotary=rotary,
                             block_mask=shared)


def lm_loss(outputs: tuple, labels: tuple) -> torch.Tensor:
    """Mean next-token cross-entropy over labels != -100."""
    return decoder_loss(outputs[0], labels[0])


def decoder_loss(logits: torch.Tensor | DeferredLogits, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [seq, batch, vocab / TP] (or the output layer's DeferredLogits)
    over labels [batch, seq] != -100; under context parallelism this rank's share of its replica's mean
    (context_parallel_token_mean)."""
    return context_parallel_token_mean(*masked_vocab_parallel_loss_sum(logits, local_tokens(labels)))


class DecoderLM(LayeredModel):
    """A causal LM's forward: loss with labels, vocab-parallel logits [batch, seq, vocab / TP] without.
    With prefix_lengths [batch] it is a prefix LM; document_ids [batch, seq] mark the packed documents
    (used as the model's document_masking / document_positions say); with a KVCache it decodes
    incrementally (one document: generation starts at an eos and stops at the next)."""

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        extras = (extra for extra in (prefix_lengths, document_ids) if extra is not None)
        (logits,) = self.run_layers((tokens, *extras), cache=cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        if labels is None:
            return as_logits(logits).transpose(0, 1)
        return decoder_loss(logits, labels)


def validate_decoder(config: Config) -> None:
    """The rules on DecoderConfig's keys, for every causal family."""
    problems = validate_moe(config.model.moe, config.parallel.sequence_parallel)
    if problems:
        raise ConfigError(problems[0])
    if config.parallel.context > 1 and config.model.moe.enabled:
        raise ConfigError(f"parallel.context={config.parallel.context} with model.moe: routing over a rank's chunks "
                          "of the sequence (its capacity and load-balancing loss) is not implemented; set "
                          "parallel.context=1 or train a dense model")
    _validate_attention_backend(config)
    window = config.model.sliding_window
    if window is not None and config.objective.kind == "prefix_lm":
        raise ConfigError(f"model.sliding_window={window} with objective.kind=prefix_lm: a window over a "
                          "bidirectional prefix is not defined here; train a prefix LM with model.sliding_window=null, "
                          "or the window with objective.kind=causal_lm (document masking works with both)")


def _validate_attention_backend(config: Config) -> None:
    model = config.model
    if model.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"model.attention_backend={model.attention_backend!r}; use sdpa, flex or auto")
    if model.attention_backend != "flex":
        return
    if model.dropout > 0:
        raise ConfigError(f"model.attention_backend=flex with model.dropout={model.dropout}: FlexAttention has no "
                          "attention dropout; set model.dropout=0, or model.attention_backend=sdpa (auto picks sdpa "
                          "when dropout is on)")
    if config.parallel.context > 1:
        raise ConfigError(f"model.attention_backend=flex with parallel.context={config.parallel.context}: context "
                          "parallelism runs its own ring attention with boolean masks per block of keys "
                          "(parallel/context_parallel.py); set model.attention_backend=auto or sdpa")
