"""ALBERT (Lan et al. 2020): BERT with a factorized embedding (a V x E table, then E -> H) and
cross-layer parameter sharing, trained with masked LM and, optionally, sentence-order prediction.

    embedding ......... word (vocab-parallel) + position + segment, LayerNorm, all of size E
    projection ........ E -> H (HF's embedding_hidden_mapping_in), replicated on every TP rank
    shared_block ...... the parameters the layers share (model.sharing), run by the blocks
    blocks.0 .. L-1 ... post-LN blocks as BERT's (model/layers.py TransformerBlock)
    heads ............. H -> E transform (dense, GELU, LayerNorm), the decoder tied to the E-wide
                        word table + bias (HF's AlbertMLMHead); pooler + classifier for SOP

Sharing (sec. 3.1, table 4): `all` (ALBERT's default) runs one block L times: every block layer is
tied to `shared_block`, so on one device it is the same module, and in pipeline stages each stage
that runs it holds a copy whose gradients DeepSpeed sums (TiedLayerSpec, as a tied embedding).
`attention` or `ffn` share that sublayer only: `shared_block` holds it and each block reaches it
through a `SharedSublayer`, beside its own norms and other sublayer. `none` is BERT with ALBERT's
embedding. Shared parameters have one name, `shared_block.*`, in every layout and checkpoint.
Under ZeRO-3 a tied block's weights are borrowed by the model (LayeredModel.borrowed_parameters),
so they are gathered once around its whole forward; a shared sublayer is gathered at each use by
its own forward hooks. Both train the single-rank losses (tests/train/test_albert_layouts.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scaletrain.batch import IGNORE_INDEX, BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig, bounded
from scaletrain.model.chunked_cross_entropy import refuse_loss_chunking
from scaletrain.model.counts import ModelCounts, transformer_block_flops
from scaletrain.model.encoder import (
    BERT,
    BertEmbedding,
    DecoderBias,
    MaskedLMObjective,
    labelled_positions,
    replicated_linear,
    run_block,
    run_decoder_bias,
    run_embedding,
    run_tied_decoder,
)
from scaletrain.model.family import PipelineLayer
from scaletrain.model.init import normal_init
from scaletrain.model.layers import ParallelAttention, ParallelMLP, TransformerBlock, gelu_tanh
from scaletrain.model.parallel_config import model_parallel_config

SHARING = ("all", "attention", "ffn", "none")
SHARED = "shared_block"
# A TransformerBlock's parameters, relative to it: what a layer tied to the shared block ties.
BLOCK_WEIGHTS = tuple(
    f"{part}.{kind}"
    for part in ("attention.qkv", "attention.output", "attention_norm", "mlp.fc", "mlp.proj", "mlp_norm")
    for kind in ("weight", "bias")
)


@dataclass
class AlbertConfig(ModelConfig):
    objective_section = MaskedLMObjective

    # E of the factorized embedding (sec. 3.1; 128 in every published size)
    embedding_size: int = bounded(128, ">= 1", "ALBERT: 128")
    type_vocab_size: int = 2  # segment embeddings
    sharing: str = "all"  # all (ALBERT) | attention | ffn | none: what the layers share (sec. 3.1, table 4)


class SharedSublayer(nn.Module):
    """Runs a sublayer that `shared_block` owns, without registering it a second time, so its
    parameters keep one name and appear once in state_dict, the optimizer and checkpoints. Its own
    forward runs, so ZeRO-3 gathers its parameters around each use."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self._owner = [owner]  # a list: not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._owner[0](*args, **kwargs)


def _attention(config: Config, name: str) -> ParallelAttention:
    model = config.model
    init = lambda part: normal_init(model.init_std, config.train.seed, f"{name}.{part}")  # noqa: E731
    return ParallelAttention(model.hidden_size, model.num_heads, model_parallel_config(config), init,
                             dropout=model.dropout)


def _mlp(config: Config, name: str) -> ParallelMLP:
    """ALBERT's released models use the tanh GELU (HF's `gelu_new`, AlbertConfig's default)."""
    model = config.model
    init = lambda part: normal_init(model.init_std, config.train.seed, f"{name}.{part}")  # noqa: E731
    return ParallelMLP(model.hidden_size, model.ffn_size, model_parallel_config(config), init, activation=gelu_tanh)


def build_block(config: Config, name: str, shared: nn.Module | None = None) -> TransformerBlock:
    """A post-LN block whose parameters live at `name`, but for the sublayer `shared` holds, if any.
    Every weight is normal(init_std), as ALBERT's initializer_range (0.02)."""
    model = config.model
    attention = SharedSublayer(shared.attention) if model.sharing == "attention" else _attention(
        config, f"{name}.attention")
    mlp = SharedSublayer(shared.mlp) if model.sharing == "ffn" else _mlp(config, f"{name}.mlp")
    return TransformerBlock(attention, mlp, lambda: nn.LayerNorm(model.hidden_size, eps=model.layernorm_eps),
                            pre_norm=False, dropout=model.dropout)


def build_shared(config: Config) -> nn.Module:
    """What `shared_block` holds: a whole block (`all`), or the one shared sublayer."""
    sharing = config.model.sharing
    if sharing == "all":
        return build_block(config, SHARED)
    shared = nn.Module()
    if sharing == "attention":
        shared.attention = _attention(config, f"{SHARED}.attention")
    else:
        shared.mlp = _mlp(config, f"{SHARED}.mlp")
    return shared


class AlbertHeads(nn.Module):
    """HF's AlbertMLMHead transform (dense H -> E, GELU, LayerNorm(E)), replicated on every TP rank
    as BERT's, and with sentence pairs the pooler (dense + tanh on [CLS]) + 2-way classifier of
    sentence-order prediction (sec. 4.2; label 0: segment B follows A)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        hidden, embedding, std = model.hidden_size, model.embedding_size, model.init_std
        self.lm_head = nn.Module()
        self.lm_head.dense = replicated_linear(hidden, embedding, std, seed, "lm_head.dense")
        self.lm_head.norm = nn.LayerNorm(embedding, eps=model.layernorm_eps)
        self.sentence_order_head = None
        if config.objective.sentence_pairs != "none":
            self.sentence_order_head = nn.Module()
            self.sentence_order_head.pooler = replicated_linear(hidden, hidden, std, seed, "sentence_order_head.pooler")
            self.sentence_order_head.classifier = replicated_linear(
                hidden, 2, std, seed, "sentence_order_head.classifier"
            )

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.norm(gelu_tanh(self.lm_head.dense(hidden)))

    def sentence_order_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.sentence_order_head
        return head.classifier(torch.tanh(head.pooler(hidden[0])))  # [CLS] position -> [batch, 2]


# Activations as BERT's (model/encoder.py); the projection maps the E-wide embedding to H, the shared
# block's owner passes them on unchanged (its blocks run it).


def _project(projection: nn.Linear, activations: tuple, **_) -> tuple:
    embedded, padding_mask = activations
    return projection(embedded), padding_mask


def _hold_shared(shared: nn.Module, activations: tuple, **_) -> tuple:
    return activations


def _heads(heads: AlbertHeads, activations: tuple, labels: torch.Tensor | None = None, **_) -> tuple:
    hidden, _ = activations  # post-LN blocks end normalised: no final norm; the padding mask is done
    selected = hidden if labels is None else hidden[labels.transpose(0, 1) != IGNORE_INDEX]
    transformed = heads.transform(selected)
    if heads.sentence_order_head is None:
        return (transformed,)
    return transformed, heads.sentence_order_logits(hidden)


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model
    seed, std, embedding_size = config.train.seed, model.init_std, model.embedding_size
    shared = functools.cache(lambda: build_shared(config))  # one instance per model the layers build
    owner = [] if model.sharing == "none" else [PipelineLayer(SHARED, shared, _hold_shared)]
    if model.sharing == "all":
        blocks = [PipelineLayer(f"blocks.{layer}", shared, run_block, is_block=True, tied_to=SHARED,
                                tied_weight=BLOCK_WEIGHTS) for layer in range(model.num_layers)]
    else:
        shared_part = (lambda: None) if model.sharing == "none" else shared
        blocks = [PipelineLayer(name, lambda name=name: build_block(config, name, shared_part()), run_block,
                                is_block=True) for name in (f"blocks.{layer}" for layer in range(model.num_layers))]
    projection = lambda: replicated_linear(embedding_size, model.hidden_size, std, seed, "projection")  # noqa: E731
    return [
        PipelineLayer("embedding", lambda: BertEmbedding(config, embedding_size), run_embedding),
        PipelineLayer("projection", projection, _project),
        *owner,
        *blocks,
        PipelineLayer("", lambda: AlbertHeads(config), _heads),
        PipelineLayer("decoder", lambda: BertEmbedding(config, embedding_size),
                      functools.partial(run_tied_decoder, sentence_order=config.objective.sentence_pairs != "none"),
                      tied_to="embedding",
                      tied_weight="word.weight"),
        PipelineLayer("lm_head", lambda: DecoderBias(config), run_decoder_bias),
    ]


class ALBERT(BERT):
    """BERT's forward, loss, sentence-order logits and masked accuracy, on ALBERT's layers."""


def build(config: Config) -> ALBERT:
    return ALBERT(pipeline_layers(config), config.train.full_recompute_interval)


def counts(config: Config, labelled: float | None = None) -> ModelCounts:
    """Parameters: each shared one once. FLOPs: every layer's application counts, shared or not, so
    they are BERT's L blocks (Kaplan et al. 2020, table 1) plus the projection 2E·H per token; the
    MLM head (transform 2H·E + decoder 2E·V) runs at the labelled positions only (`labelled_positions`,
    or `labelled` per sample of one batch), the sentence-order head (2H² + 4H) once per sample."""
    model, vocab = config.model, config.padded_vocab_size
    hidden, ffn, layers, seq, embedding = (model.hidden_size, model.ffn_size, model.num_layers, model.seq_length,
                                           model.embedding_size)
    pairs = config.objective.sentence_pairs != "none"
    attention, mlp, norms = 4 * hidden * hidden + 4 * hidden, 2 * hidden * ffn + ffn + hidden, 4 * hidden
    per_layer = {"all": 0, "attention": mlp + norms, "ffn": attention + norms, "none": attention + mlp + norms}
    shared = {"all": attention + mlp + norms, "attention": attention, "ffn": mlp, "none": 0}
    lookups = (vocab + seq + model.type_vocab_size) * embedding
    projection = embedding * hidden + hidden
    head = hidden * embedding + 3 * embedding + vocab  # transform dense + bias, LayerNorm, decoder bias
    sentence_order = hidden * hidden + hidden + 2 * hidden + 2 if pairs else 0
    total = (lookups + 2 * embedding + projection + shared[model.sharing] + layers * per_layer[model.sharing]
             + head + sentence_order)
    labelled = labelled_positions(config) if labelled is None else labelled
    sample_flops = seq * (layers * transformer_block_flops(hidden, ffn, seq) + 2 * embedding * hidden)
    sample_flops += labelled * (2 * hidden * embedding + 2 * embedding * vocab)
    if pairs:
        sample_flops += 2 * hidden * hidden + 4 * hidden
    return ModelCounts(
        total_params=total, embedding_params=lookups, flops_per_token=3.0 * sample_flops / seq,
        flops_formula="3·(l·(8h² + 4h·ffn + 4h·s) + 2E·h + (m/s)·(2h·E + 2E·V) [+ (2h² + 4h)/s with SOP]) with "
                      "E the embedding size, m the labelled positions per sample; shared layers count l times",
    )


def validate(config: Config) -> None:
    refuse_loss_chunking(config, "its masked-LM logits are made at the masked positions only (about 15% of the "
                                 "tokens) and take a bias after the output layer")
    model, parallel = config.model, config.parallel
    if model.sharing not in SHARING:
        raise ConfigError(f"model.sharing={model.sharing!r}; use all (ALBERT), attention, ffn or none")
    minimum_types = 2 if config.objective.sentence_pairs != "none" else 1
    if model.type_vocab_size < minimum_types:
        raise ConfigError(
            f"model.type_vocab_size={model.type_vocab_size}; sentence pairs need segment ids 0 and 1, "
            f"so use >= {minimum_types}"
        )
    if parallel.pipeline > 1 and model.sharing in ("attention", "ffn"):
        raise ConfigError(
            f"parallel.pipeline={parallel.pipeline} with model.sharing={model.sharing}: a sublayer shared by "
            "blocks on several stages cannot be tied; pipeline ALBERT with model.sharing=all or none, or train "
            "this one with tensor and data parallelism (parallel.pipeline=1)"
        )
    if parallel.pipeline > 1 and model.sharing == "all" and config.train.recompute == "full":
        raise ConfigError(
            "train.activation_checkpoint=full (or train.activation_checkpoint_interval > 0) with parallel.pipeline>1 "
            "and model.sharing=all: DeepSpeed recomputes only the layers a stage builds itself, not the shared "
            "block it runs; use train.activation_checkpoint=selective (or none) with "
            "train.activation_checkpoint_interval=0, or recompute fully with parallel.pipeline=1 or model.sharing=none"
        )


def batch_schema(config: Config) -> BatchSchema:
    return BatchSchema(inputs=("tokens", "token_types", "padding_mask"), labels=("labels",),
                       optional_labels=("sentence_order_labels",))
