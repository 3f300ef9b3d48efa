"""Which keys a causal decoder's queries may attend: packed documents, a prefix, a sliding window.

Every mask here is SDPA's boolean form (True: may attend), [query, key] or [batch, 1, query, key].
Three independent limits compose by AND, and every query always keeps its own key, so no softmax
row is empty:

    causal           key j <= query i (GPT; Radford et al. 2018)
    documents        i and j lie in the same packed document (Megatron's `reset_attention_mask`;
                     Llama 3 masks attention between documents, Dubey et al. 2024, sec. 3.2)
    sliding window   j > i - W: a query sees itself and the W - 1 keys before it (Longformer's local
                     attention, Beltagy et al. 2020, made causal by Mistral, Jiang et al. 2023). This is
                     Hugging Face's convention (transformers' masking_utils.sliding_window_overlay:
                     `kv_idx > q_idx - sliding_window`), so a Mistral export computes what we do.

A prefix LM (Raffel et al. 2020, sec. 3.2.3) replaces "causal" by "causal or j in the prefix".

Documents are given as `document_ids` [batch, seq]: equal ids mark one document, and a new document
starts where the id changes (data/objectives.py makes them from the eos separators). Positions may
restart at each document start (Megatron's `reset_position_ids`, Hugging Face's packed `position_ids`),
so a document in a pack sees exactly the positions it would see alone.

Two forms of the same limits: SDPA's boolean mask, which costs O(s²) memory and compute whatever the
documents or the window leave, and FlexAttention's block mask (`decoder_block_mask`; Dong et al. 2024,
"Flex Attention"), whose kernel skips the 128 x 128 tiles in which no query sees a key and evaluates the
rule only on tiles that are partly visible. `model.attention_backend` picks one for training forwards
(model/decoder.py `attention_backend`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def causal_mask(query_length: int, key_length: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[query, key]: the queries are the last `query_length` of `key_length` positions (bottom-right
    aligned, as in incremental decoding behind a KV cache); query i sees key j if j <= i and, with a
    window W, j > i - W."""
    keys = torch.arange(key_length, device=device)
    return visible_keys(keys[key_length - query_length:], keys, window=window)


def sliding_window_mask(query_length: int, key_length: int, device: torch.device, window: int) -> torch.Tensor:
    """[query, key], bottom-right aligned: key j is less than `window` positions behind query i
    (j > i - W), with no causal limit of its own, to AND with a mask that already has one."""
    keys = torch.arange(key_length, device=device)
    return _within_window(keys[key_length - query_length:], keys, window)


def _within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    return key_positions[None, :] > query_positions[:, None] - window


def positions_in_document(document_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] int64: each token's distance from the first token of its document."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def decoder_attention_mask(
    seq_length: int, device: torch.device, prefix_lengths: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The mask of a training forward before any sliding window (the attention layer adds that):
    causal or prefix LM, within documents when `document_ids` are given; None for plain causal,
    which SDPA computes without a mask (`is_causal`)."""
    if prefix_lengths is None and document_ids is None:
        return None
    positions = torch.arange(seq_length, device=device)
    return visible_keys(positions, positions, prefix_lengths, document_ids)


def visible_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, prefix_lengths: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None, window: int | None = None,
) -> torch.Tensor:
    """The limits of the module docstring for queries and keys at the given positions of the sequence:
    all of it (training), the newest queries behind a KV cache, or context parallelism's chunks.
    [query, key], or [batch, 1, query, key] with a prefix or documents; `document_ids` [batch, seq] are
    the whole sequence's."""
    visible = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        visible = visible & _within_window(query_positions, key_positions, window)
    if prefix_lengths is not None:
        visible = (visible[None] | (key_positions[None, None, :] < prefix_lengths[:, None, None]))[:, None]
    if document_ids is not None:
        queries, keys = document_ids[:, query_positions], document_ids[:, key_positions]
        visible = visible & (queries[:, :, None] == keys[:, None, :])[:, None]
    return visible


def visible_keys_mask_mod(
    prefix_lengths: torch.Tensor | None = None, document_ids: torch.Tensor | None = None, window: int | None = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`visible_keys` of a training forward (queries and keys both at 0..s-1) as FlexAttention's mask_mod
    (batch, head, query, key) -> may attend: the same limits, composed in the same order."""

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        visible = key <= query
        if window is not None:
            visible = visible & (key > query - window)
        if prefix_lengths is not None:
            visible = visible | (key < prefix_lengths[batch])
        if document_ids is not None:
            visible = visible & (document_ids[batch, query] == document_ids[batch, key])
        return visible

    return mask_mod


def decoder_block_mask(
    seq_length: int, device: torch.device, prefix_lengths: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None, window: int | None = None,
) -> BlockMask | None:
    """`decoder_attention_mask` and the sliding window as one FlexAttention BlockMask, [batch or 1, 1, s, s];
    None where only causality limits attention (SDPA's `is_causal` runs that as fast)."""
    if window is not None and window >= seq_length:
        window = None  # no query reaches past it
    if prefix_lengths is None and document_ids is None and window is None:
        return None
    batch = next((extra.shape[0] for extra in (prefix_lengths, document_ids) if extra is not None), None)
    build = _compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    return build(visible_keys_mask_mod(prefix_lengths, document_ids, window), batch, None, seq_length, seq_length,
                 device=device)


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    """create_block_mask compiled, as torchtitan builds its document masks: eager, it materialises the dense
    [batch, s, s] mask on the way to the block mask; compiled, it evaluates the rule tile by tile."""
    return torch.compile(create_block_mask)


class SharedBlockMask:
    """The BlockMask of the micro-batch in flight, built by the first block that asks and reused by the
    others: every block of a forward (and a recomputation of it) gets the same extras tensors, so they are
    recognised by identity, and by version against a buffer refilled in place. One per model; it holds the
    last micro-batch's tensors and rebuilds when they change (as between a pipeline stage's interleaved
    forwards and backwards)."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._extras: tuple[torch.Tensor | None, ...] = (None, None)
        self._key: tuple = ()
        self._mask: BlockMask | None = None

    def get(self, seq_length: int, device: torch.device, prefix_lengths: torch.Tensor | None,
            document_ids: torch.Tensor | None) -> BlockMask | None:
        extras = (prefix_lengths, document_ids)
        key = (seq_length, device, *(None if extra is None else extra._version for extra in extras))
        if key != self._key or any(held is not extra for held, extra in zip(self._extras, extras, strict=True)):
            self._mask = decoder_block_mask(seq_length, device, prefix_lengths, document_ids, self.window)
            self._extras, self._key = extras, key
        return self._mask


@dataclass(frozen=True)
class DocumentAttention:
    """What a decoder does with the document ids of a packed batch: mask attention to the document,
    restart positions at each document, both, or neither (then the batch carries no ids)."""

    masking: bool = False
    positions: bool = False

    @property
    def reads_document_ids(self) -> bool:
        return self.masking or self.positions
