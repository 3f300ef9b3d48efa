"""What the encoder-decoder families share (t5, bart): the `EncoderDecoderLM` forward (encoder once,
decoder with a KV cache when generating), the name of the decoder's embedding, the tensor-parallel
split check and the FLOPs per token of an encoder-decoder. A family adds its config, layers and counts
(families/t5/model.py, families/bart/model.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from scaletrain.model.family import LayeredModel
from scaletrain.model.layers import KVCache, masked_vocab_parallel_loss


class SplitShapes(Protocol):
    """The sizes of an encoder-decoder that tensor parallelism splits (T5Architecture, BartArchitecture)."""

    num_heads: int
    ffn_hidden_size: int
    vocab_size: int


DECODER_EMBEDDING = "decoder.embedding"


class EncoderDecoderLM(LayeredModel):
    """An encoder-decoder LM's pipeline layers on one device (families/t5/model.py, families/bart/model.py): the
    shared embedding, the encoder's layers, then the decoder's (named `decoder.*`, the first being
    DECODER_EMBEDDING) and the output layers after them, with the activations of T5's t5_layers.

    `forward` runs every layer (recomputing blocks with checkpoint_interval while training);
    `encode`, `decode` and `output_logits` run the encoder, decoder and output layers for generation.
    """

    def forward(
        self,
        encoder_tokens: torch.Tensor,
        decoder_tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        encoder_padding_mask: torch.Tensor | None = None,
        decoder_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens and masks [batch, seq] (mask 1 = real token) -> mean cross-entropy over labels
        != -100 if labels are given, else vocab-parallel logits [batch, dec_seq, vocab / TP]."""
        (logits,) = self.run_layers((encoder_tokens, decoder_tokens, encoder_padding_mask, decoder_padding_mask))
        if labels is None:
            return logits.transpose(0, 1)
        return masked_vocab_parallel_loss(logits, labels)

    def encode(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] -> encoder output [seq, batch, hidden]."""
        return self.run_layers((tokens, None, padding_mask, None), until=DECODER_EMBEDDING)[0]

    def decode(
        self,
        tokens: torch.Tensor,
        encoder_output: torch.Tensor,
        encoder_padding_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Decoder input tokens [batch, seq] (shifted right) -> decoder output [seq, batch, hidden].
        With a KVCache the tokens continue the cached ones (incremental decoding)."""
        activations = (encoder_output, encoder_padding_mask, tokens, padding_mask)
        for layer, module in self._layers[self._decoder_start():self._output_start()]:
            activations = layer.run(module, activations, cache=cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        return activations[0]

    def output_logits(self, decoder_output: torch.Tensor) -> torch.Tensor:
        """[seq, batch, hidden] -> this rank's vocabulary shard of the logits [seq, batch, vocab / TP]."""
        activations = (decoder_output,)
        for layer, module in self._layers[self._output_start():]:
            activations = layer.run(module, activations)
        return activations[0]

    def _decoder_start(self) -> int:
        return next(index for index, (layer, _) in enumerate(self._layers) if layer.name == DECODER_EMBEDDING)

    def _output_start(self) -> int:
        """The first layer after the decoder's: the output layer (and BART's logits bias)."""
        return 1 + max(index for index, (layer, _) in enumerate(self._layers) if layer.name.startswith("decoder."))


def check_split_evenly(architecture: SplitShapes, tensor_parallel_size: int) -> None:
    """An encoder-decoder's heads, FFN columns and vocabulary rows (architecture's num_heads,
    ffn_hidden_size and vocab_size) split evenly across TP ranks."""
    for name in ("num_heads", "ffn_hidden_size", "vocab_size"):
        value = getattr(architecture, name)
        if value % tensor_parallel_size:
            sizes = ", ".join(str(size) for size in range(1, min(value, 64) + 1) if value % size == 0)
            raise ValueError(
                f"tensor parallel size {tensor_parallel_size} does not divide {name}={value}; use one of {sizes}"
            )


def encoder_decoder_flops_per_token(
    hidden: int, inner: int, ffn_weights: int, vocab: int, encoder_layers: int, decoder_layers: int,
    encoder_length: int, decoder_length: int,
) -> float:
    """Training FLOPs per encoder token of an encoder-decoder with `ffn_weights` FFN weights per
    layer and attention width `inner` (T5's `counts` states the formula; BART's is the same with
    i = h): each stack's matmuls over its own tokens, cross-attention keys and values projected
    from the s_e encoder outputs, the output layer at the s_d decoder positions, times 3 for backward."""
    attention = 4 * hidden * inner  # QKV + output
    encoder_flops = encoder_length * encoder_layers * (2 * attention + 2 * ffn_weights + 4 * inner * encoder_length)
    decoder_token = (2 * attention + 2 * 2 * hidden * inner + 2 * ffn_weights
                     + 4 * inner * (decoder_length + encoder_length))
    decoder_flops = decoder_layers * (decoder_length * decoder_token + encoder_length * 2 * 2 * hidden * inner)
    head_flops = decoder_length * 2 * hidden * vocab
    return 3.0 * (encoder_flops + decoder_flops + head_flops) / encoder_length
