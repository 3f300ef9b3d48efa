"""BERT encoder (Devlin et al. 2019) on tensor-parallel layers, with its masked-LM and sentence-pair heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletrain.config import ModelConfig
from scaletrain.data.objectives import IGNORE_INDEX
from scaletrain.model.init import normal_init, residual_std
from scaletrain.model.layers import (
    PostLayerNormBlock,
    PreLayerNormBlock,
    build_attention_and_mlp,
    gelu_erf,
    key_padding_attention_mask,
    parallel_lm_logits,
    vocab_parallel_argmax,
)

LAYERNORM_POSITIONS = ("post", "pre")


class BertEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position + token-type (segment) embeddings, then LayerNorm
    (Devlin et al. 2019, sec. 3.2 and fig. 2); output [seq, batch, hidden]."""

    def __init__(
        self, config: ModelConfig, vocab_size: int, type_vocab_size: int, mp_config: ModelParallelConfig, seed: int
    ) -> None:
        super().__init__()
        self.word = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=normal_init(config.init_std, seed, "embedding.word"),
            config=mp_config,
        )
        self.position = nn.Embedding(config.seq_length, config.hidden_size)
        self.token_type = nn.Embedding(type_vocab_size, config.hidden_size)
        with torch.no_grad():
            normal_init(config.init_std, seed, "embedding.position")(self.position.weight)
            normal_init(config.init_std, seed, "embedding.token_type")(self.token_type.weight)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        embedded = self.word(tokens) + self.position(positions) + self.token_type(token_types)
        return self.dropout(self.norm(embedded).transpose(0, 1).contiguous())


class MaskedLMHead(nn.Module):
    """BERT's `cls/predictions`: dense + GELU + LayerNorm, then the decoder tied to the word
    embedding, with its own output bias.

    The hidden x hidden transform is replicated on every TP rank, as Megatron's BertLMHead does:
    it is small next to the decoder, and its replicated output is exactly the input the
    vocab-split decoder (`parallel_lm_logits`) takes, so it costs no collective. The bias is
    split like the decoder rows (partition_dim 0), so `merge_shards` restores the full vector.
    """

    def __init__(self, config: ModelConfig, vocab_size: int, mp_config: ModelParallelConfig, seed: int) -> None:
        super().__init__()
        self.dense = replicated_linear(config.hidden_size, config.hidden_size, config.init_std, seed, "lm_head.dense")
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size // mp_config.tensor_model_parallel_size))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return parallel_lm_logits(self.transform(hidden), word_embeddings) + self.bias

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(gelu_erf(self.dense(hidden)))


class SentenceOrderHead(nn.Module):
    """Pooler (dense + tanh on the first, [CLS], position) and a 2-way classifier.

    Serves BERT's next-sentence prediction (Devlin et al. 2019, sec. 3.1, task #2) and ALBERT's
    sentence-order prediction (Lan et al. 2020, sec. 4.2); they differ only in how the data
    pairs segments. Label 0: segment B follows A in order; 1: B is random or swapped (HF's rule).
    """

    def __init__(self, config: ModelConfig, seed: int) -> None:
        super().__init__()
        hidden, std = config.hidden_size, config.init_std
        self.pooler = replicated_linear(hidden, hidden, std, seed, "sentence_order_head.pooler")
        self.classifier = replicated_linear(hidden, 2, std, seed, "sentence_order_head.classifier")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(hidden[0])))  # [batch, 2]


class BERT(nn.Module):
    """Bidirectional encoder: embedding, post-LN blocks (pre-LN selectable, then with a final
    LayerNorm as in Xiong et al. 2020), masked-LM head and optional sentence-order head."""

    def __init__(
        self,
        config: ModelConfig,
        vocab_size: int,
        mp_config: ModelParallelConfig,
        seed: int,
        type_vocab_size: int = 2,
        layernorm_position: str = "post",
        sentence_order_head: bool = False,
        checkpoint_interval: int = 0,
    ) -> None:
        super().__init__()
        if layernorm_position not in LAYERNORM_POSITIONS:
            raise ValueError(f"layernorm_position={layernorm_position!r}; use post (BERT) or pre (GPT-2 style)")
        self.config = config
        self.checkpoint_interval = checkpoint_interval
        self.embedding = BertEmbedding(config, vocab_size, type_vocab_size, mp_config, seed)
        self.blocks = nn.ModuleList(
            build_bert_block(config, mp_config, seed, layer, layernorm_position) for layer in range(config.num_layers)
        )
        pre_layernorm = layernorm_position == "pre"
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps) if pre_layernorm else nn.Identity()
        self.lm_head = MaskedLMHead(config, vocab_size, mp_config, seed)
        self.sentence_order_head = SentenceOrderHead(config, seed) if sentence_order_head else None

    def flat_layer_parameter_name(self, layer_index: int, name_in_layer: str) -> str | None:
        """BERT as a flat layer sequence, the order pipeline stages split it (parallel/pipeline.py):
            0: embedding   1..L: blocks   L+1: final   L+2: head transform + sentence-order head
            L+3: decoder tied to the embedding (no weights of its own)   L+4: decoder bias."""
        num_layers = self.config.num_layers
        if layer_index == 0 or layer_index == num_layers + 1 or layer_index == num_layers + 2:
            return name_in_layer
        if layer_index <= num_layers:
            return f"blocks.{layer_index - 1}.{name_in_layer.removeprefix('block.')}"
        return "lm_head.bias" if layer_index == num_layers + 4 else None

    def borrowed_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs where a module uses a weight it does not own: the MLM decoder is
        tied to the word embedding. Sharded-parameter engines (ZeRO-3) must gather it for that module."""
        return [(self.lm_head, self.embedding.word.weight)]

    def forward(
        self,
        tokens: torch.Tensor,
        token_types: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        sentence_order_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, token_types, padding_mask (1 = real token), labels (-100 = not predicted): [batch, seq];
        sentence_order_labels: [batch]. Returns the loss if labels are given (masked-LM mean over
        labelled tokens, plus the sentence-order cross-entropy if those labels are given, as BERT
        sums its two pre-training losses), else vocab-parallel logits [batch, seq, vocab / TP]."""
        if sentence_order_labels is not None and self.sentence_order_head is None:
            raise ValueError(
                "sentence_order_labels were given but this BERT has no sentence-order head; "
                "build it with sentence_order_head=True (objective.sentence_pairs: nsp or sop) or drop the labels"
            )
        hidden = self.encode(tokens, token_types, padding_mask)
        if labels is None:
            return self.lm_head(hidden, self.embedding.word.weight).transpose(0, 1)
        selected, targets = _labelled_positions(hidden, labels)
        logits = self.lm_head(selected, self.embedding.word.weight)
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)
        loss = losses.sum() / max(targets.numel(), 1)
        if sentence_order_labels is not None:
            loss = loss + F.cross_entropy(self.sentence_order_head(hidden).float(), sentence_order_labels)
        return loss

    def encode(
        self, tokens: torch.Tensor, token_types: torch.Tensor | None, padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Final hidden states [seq, batch, hidden]; padding_mask None means no padding."""
        hidden = self.embedding(tokens, torch.zeros_like(tokens) if token_types is None else token_types)
        mask = None if padding_mask is None else key_padding_attention_mask(padding_mask)
        interval = self.checkpoint_interval if self.training else 0
        if not interval:
            return self.final_norm(_run_blocks(self.blocks, hidden, mask))
        for start in range(0, len(self.blocks), interval):
            # Keep only each chunk's input; recompute its activations in backward (Chen et al. 2016).
            hidden = checkpoint(_run_blocks, self.blocks[start:start + interval], hidden, mask, use_reentrant=False)
        return self.final_norm(hidden)

    def sentence_order_logits(
        self, tokens: torch.Tensor, token_types: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[batch, 2] logits of the sentence-order head (label 0: in order)."""
        if self.sentence_order_head is None:
            raise ValueError("this BERT has no sentence-order head; build it with sentence_order_head=True")
        return self.sentence_order_head(self.encode(tokens, token_types, padding_mask))

    @torch.no_grad()
    def masked_token_accuracy(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        token_types: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct, labelled) counts of labelled positions whose full-vocabulary argmax is the label.
        Counts rather than a ratio, so validation can sum them over batches and data-parallel ranks."""
        selected, targets = _labelled_positions(self.encode(tokens, token_types, padding_mask), labels)
        predictions = vocab_parallel_argmax(self.lm_head(selected, self.embedding.word.weight))
        return (predictions == targets).sum(), torch.tensor(targets.numel(), device=targets.device)


def _labelled_positions(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [n, hidden] and labels [n] of the positions that have a label. The head runs
    on these only (~15% of tokens), as BERT's run_pretraining.py gathers masked positions first."""
    labels = labels.transpose(0, 1)
    chosen = labels != IGNORE_INDEX
    return hidden[chosen], labels[chosen]


def _run_blocks(blocks: nn.ModuleList, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    for block in blocks:
        hidden = block(hidden, mask)
    return hidden


def replicated_linear(in_features: int, out_features: int, std: float, seed: int, name: str) -> nn.Linear:
    """nn.Linear copied on every TP rank: normal(std) weight keyed by name, zero bias (BERT's init)."""
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        normal_init(std, seed, name)(linear.weight)
        linear.bias.zero_()
    return linear


def build_bert_block(
    config: ModelConfig, mp_config: ModelParallelConfig, seed: int, layer: int, layernorm_position: str
) -> PostLayerNormBlock | PreLayerNormBlock:
    """BERT initialises every weight with std 0.02 (Devlin et al. 2019, HF's initializer_range).
    A pre-LN stack's residual stream grows with depth, so there the output projections take
    GPT-2's 1/sqrt(2 * layers) scaling (Radford et al. 2019, sec. 2.3); post-LN renormalises it."""
    pre_layernorm = layernorm_position == "pre"
    output_std = residual_std(config.init_std, config.num_layers) if pre_layernorm else config.init_std
    attention, mlp = build_attention_and_mlp(
        config, mp_config, seed, layer, causal=False, output_std=output_std, activation=gelu_erf
    )
    block = PreLayerNormBlock if pre_layernorm else PostLayerNormBlock
    return block(attention, mlp, config.hidden_size, config.layernorm_eps, config.dropout)
