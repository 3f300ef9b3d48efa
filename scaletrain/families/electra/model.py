"""ELECTRA (Clark et al. 2020): a small masked-LM generator and a discriminator that tells which of
the tokens the generator sampled replaced the originals, trained jointly on L_MLM + λ·L_disc.

Both are BERT encoders (post-LN blocks of the kit, exact GELU) that share one embedding module of
width E (word, position and token-type tables and their LayerNorm: sec. 3.2 "tied embeddings", and
google-research/electra builds both under `electra/embeddings`); an encoder wider than E first
projects it (HF's `embeddings_project`). The generator has the discriminator's depth and a fraction
of its width (paper, table 6: 1/4 for Small, 1/3 for Base); its MLM head (dense -> GELU ->
LayerNorm to E, decoder tied to the word embedding, HF's ElectraGeneratorPredictions) runs at the
masked positions only. The discriminator's head (dense -> GELU -> dense to 1 logit per token, HF's
ElectraDiscriminatorPredictions) scores every token.

Layers, run in order by LayeredModel (activations [seq, batch, ...] as in layers.py; the MLM labels
and the sampling noise arrive as context, see `forward`):

    embedding ........................ (tokens, token_types, padding_mask)
                                       -> (hidden_E, padding_mask, tokens, token_types)
    generator.embedding_project ...... (only if E != generator width)
    generator.blocks.{i} ............. same
    generator (lm_head transform) .... hidden at the masked positions -> transformed [masked, E]
    generator.decoder (tied) ......... -> generator logits [masked, vocab / TP]
    generator.lm_head (its bias) ..... same
    discriminator.embedding (tied) ... sample replacements, embed the corrupted tokens
                                       -> (hidden_E, padding_mask, generator_logits, replaced)
    discriminator.embedding_project .. (only if E != hidden_size)
    discriminator.blocks.{i} ......... same
    discriminator (head) ............. -> (generator_logits, discriminator_logits [batch, seq], replaced,
                                           padding_mask, discriminator_weight)

No pipeline stages: the discriminator's input depends on the generator's samples at the masked
positions, whose labels and noise only the last stage would hold; TP and DP/ZeRO train it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from torch import nn

from scaletrain.batch import IGNORE_INDEX, Batch, BatchSchema
from scaletrain.config import Config, ConfigError, ModelConfig, bounded
from scaletrain.families.electra.replaced_tokens import REPLACED_TOKEN_DETECTION, REPLACEMENT_UNIFORMS
from scaletrain.model.chunked_cross_entropy import refuse_loss_chunking
from scaletrain.model.counts import ModelCounts, transformer_block_flops
from scaletrain.model.encoder import (
    BertEmbedding,
    DecoderBias,
    MaskingObjective,
    labelled_positions,
    replicated_linear,
)
from scaletrain.model.family import LayeredModel, PipelineLayer
from scaletrain.model.init import normal_init
from scaletrain.model.layers import (
    ParallelAttention,
    ParallelMLP,
    TransformerBlock,
    gelu_erf,
    key_padding_attention_mask,
    parallel_lm_logits,
    vocab_parallel_argmax,
)
from scaletrain.model.parallel_config import model_parallel_config

OBJECTIVE = REPLACED_TOKEN_DETECTION.name


@dataclass(frozen=True)
class EncoderShape:
    hidden_size: int
    num_heads: int
    ffn_size: int
    num_layers: int


@dataclass
class ElectraConfig(ModelConfig):
    """num_layers, hidden_size, num_heads, ffn_hidden_size: the discriminator's. The generator's
    default to the paper's Small ratio (table 6): 1/4 of the width, heads and FFN, the same depth."""

    objective_section = MaskingObjective

    embedding_size: int | None = None  # E, shared by both encoders; None: hidden_size (Base, Large)
    generator_hidden_size: int | None = None  # None: hidden_size / 4
    generator_num_heads: int | None = None  # None: num_heads / 4 (at least 1)
    generator_ffn_hidden_size: int | None = None  # None: 4 * generator hidden size
    generator_num_layers: int | None = None  # None: num_layers
    # λ of L_MLM + λ·L_disc (paper, sec. 2 and table 6)
    discriminator_weight: float = bounded(50.0, ">= 0", "the paper's λ is 50")
    type_vocab_size: int = bounded(2, ">= 1")  # segment embeddings

    @property
    def embedding_width(self) -> int:
        return self.embedding_size or self.hidden_size

    @property
    def discriminator(self) -> EncoderShape:
        return EncoderShape(self.hidden_size, self.num_heads, self.ffn_size, self.num_layers)

    @property
    def generator(self) -> EncoderShape:
        hidden = self.generator_hidden_size or max(1, self.hidden_size // 4)
        return EncoderShape(hidden, self.generator_num_heads or max(1, self.num_heads // 4),
                            self.generator_ffn_hidden_size or 4 * hidden, self.generator_num_layers or self.num_layers)


# ---------------------------------------------------------------------------------------------
# Sampling the generator's replacements


@torch.no_grad()
def sample_from_vocab_parallel(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of vocab-parallel logits [rows, vocab / TP], drawn from their softmax by
    the inverse CDF at `uniforms` [rows] in [0, 1): the first index whose cumulative probability
    exceeds u. Identical on every TP rank.

    Why the inverse CDF: one uniform per masked position comes from the collator, keyed by (seed,
    global index, position) like the masking noise, so every layout and a resumed run draw the same
    noise; Gumbel-max would need a noise value per vocabulary entry. Each rank sums exp(logit - max)
    over its shard (float64, after an all-reduced max); the shard totals, all-gathered, give each
    shard's offset into the CDF; every rank proposes the first of its indices past u·total and the
    smallest proposal wins. Given the same logits, TP=1 and TP>1 agree unless u falls within float64
    rounding of a CDF step. No gradient flows through the sample (paper, sec. 2: the generator is
    trained by maximum likelihood, not adversarially).
    """
    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    logits = logits.detach().double()
    shift = logits.max(dim=-1).values
    if world > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    cumulative = torch.exp(logits - shift[:, None]).cumsum_(dim=-1)
    shard_totals = [cumulative[:, -1].contiguous() for _ in range(world)]
    if world > 1:
        dist.all_gather(shard_totals, shard_totals[0], group=group)
    running = torch.stack(shard_totals).cumsum(dim=0)  # [world, rows]: the CDF at each shard's end
    rank = parallel_state.get_tensor_model_parallel_rank()
    offset = running[rank - 1] if rank > 0 else torch.zeros_like(running[0])
    total = running[-1]
    # u < 1, but u·total may round up to total: keep the target below the CDF's last step
    target = torch.minimum(uniforms.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    past = (offset[:, None] + cumulative) > target[:, None]
    first = past.int().argmax(dim=-1) + rank * logits.shape[-1]
    candidate = torch.where(past.any(dim=-1), first, torch.iinfo(torch.long).max)
    if world > 1:
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


def replace_masked_tokens(
    tokens: torch.Tensor, labels: torch.Tensor, generator_logits: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(corrupted tokens, replaced) [batch, seq]: every masked position (label != -100) takes a token
    sampled from the generator, whose logits are in the masked positions' [seq, batch] order;
    `replaced` marks tokens that differ from the original (a sample equal to the original counts as
    original, paper sec. 2)."""
    masked = labels.transpose(0, 1) != IGNORE_INDEX
    corrupted = tokens.transpose(0, 1).clone()
    corrupted[masked] = sample_from_vocab_parallel(generator_logits, uniforms.transpose(0, 1)[masked])
    originals = torch.where(labels != IGNORE_INDEX, labels, tokens)
    corrupted = corrupted.transpose(0, 1).contiguous()
    return corrupted, corrupted != originals


# ---------------------------------------------------------------------------------------------
# Modules


def build_block(config: Config, shape: EncoderShape, stack: str, layer: int) -> TransformerBlock:
    """A post-LN BERT block of either encoder; every weight normal(init_std) keyed by its name."""
    model, seed = config.model, config.train.seed

    def init(sublayer: str):
        return lambda part: normal_init(model.init_std, seed, f"{stack}.blocks.{layer}.{sublayer}.{part}")

    mp_config = model_parallel_config(config)
    attention = ParallelAttention(shape.hidden_size, shape.num_heads, mp_config, init("attention"),
                                  dropout=model.dropout, layer_index=layer)
    mlp = ParallelMLP(shape.hidden_size, shape.ffn_size, mp_config, init("mlp"), activation=gelu_erf)
    return TransformerBlock(attention, mlp, lambda: nn.LayerNorm(shape.hidden_size, eps=model.layernorm_eps),
                            pre_norm=False, dropout=model.dropout)


class GeneratorHead(nn.Module):
    """The generator's MLM transform, dense (generator width -> E) + GELU + LayerNorm(E), replicated
    on every TP rank as BertHeads' is; the decoder is the tied word embedding."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model = config.model
        self.lm_head = nn.Module()
        self.lm_head.dense = replicated_linear(model.generator.hidden_size, model.embedding_width, model.init_std,
                                               config.train.seed, "generator.lm_head.dense")
        self.lm_head.norm = nn.LayerNorm(model.embedding_width, eps=model.layernorm_eps)

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.norm(gelu_erf(self.lm_head.dense(hidden)))


class DiscriminatorHead(nn.Module):
    """dense (H -> H) + GELU + dense (H -> 1): one replaced-or-original logit per token, replicated."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        model, seed = config.model, config.train.seed
        self.head = nn.Module()
        self.head.dense = replicated_linear(model.hidden_size, model.hidden_size, model.init_std, seed,
                                            "discriminator.head.dense")
        self.head.prediction = replicated_linear(model.hidden_size, 1, model.init_std, seed,
                                                 "discriminator.head.prediction")
        self.discriminator_weight = model.discriminator_weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[seq, batch, H] -> [batch, seq]."""
        return self.head.prediction(gelu_erf(self.head.dense(hidden))).squeeze(-1).transpose(0, 1)


def _embed(embedding: BertEmbedding, activations: tuple, **_) -> tuple:
    tokens, token_types, padding_mask = activations
    return embedding(tokens, token_types), padding_mask, tokens, token_types


def _project(projection: nn.Linear, activations: tuple, **_) -> tuple:
    hidden, *rest = activations
    return projection(hidden), *rest


def _block(block: TransformerBlock, activations: tuple, **_) -> tuple:
    hidden, padding_mask, *rest = activations
    return block(hidden, key_padding_attention_mask(padding_mask)), padding_mask, *rest


def _generator_head(head: GeneratorHead, activations: tuple, labels: torch.Tensor | None = None, **_) -> tuple:
    """At the masked positions only while training (labels given), as BERT's head; else everywhere."""
    hidden, *rest = activations
    selected = hidden if labels is None else hidden[labels.transpose(0, 1) != IGNORE_INDEX]
    return head.transform(selected), *rest


def _decoder(embedding: BertEmbedding, activations: tuple, **_) -> tuple:
    transformed, *rest = activations
    return parallel_lm_logits(transformed, embedding.word.weight), *rest


def _decoder_bias(bias: DecoderBias, activations: tuple, **_) -> tuple:
    logits, *rest = activations
    return logits + bias.bias, *rest


def _embed_replaced(
    embedding: BertEmbedding, activations: tuple, labels: torch.Tensor | None = None,
    replacement_uniforms: torch.Tensor | None = None, **_,
) -> tuple:
    """The discriminator reads the tokens with the generator's samples at the masked positions (with
    no labels, the tokens as given) through the shared embedding."""
    generator_logits, padding_mask, tokens, token_types = activations
    replaced = torch.zeros_like(tokens, dtype=torch.bool)
    if labels is not None:
        tokens, replaced = replace_masked_tokens(tokens, labels, generator_logits, replacement_uniforms)
    return embedding(tokens, token_types), padding_mask, generator_logits, replaced


def _discriminator_head(head: DiscriminatorHead, activations: tuple, **_) -> tuple:
    """The outputs the loss reads; λ travels with them because a loss sees tensors, not the config."""
    hidden, padding_mask, generator_logits, replaced = activations
    weight = torch.tensor(head.discriminator_weight, device=hidden.device)
    return generator_logits, head.logits(hidden), replaced, padding_mask, weight


def _encoder_layers(config: Config, stack: str, shape: EncoderShape) -> list[PipelineLayer]:
    model = config.model
    layers = []
    if model.embedding_width != shape.hidden_size:
        layers.append(PipelineLayer(
            f"{stack}.embedding_project",
            lambda: replicated_linear(model.embedding_width, shape.hidden_size, model.init_std, config.train.seed,
                                      f"{stack}.embedding_project"),
            _project,
        ))
    layers += [PipelineLayer(f"{stack}.blocks.{layer}", lambda layer=layer: build_block(config, shape, stack, layer),
                             _block, is_block=True) for layer in range(shape.num_layers)]
    return layers


def pipeline_layers(config: Config) -> list[PipelineLayer]:
    model = config.model

    def embedding() -> BertEmbedding:
        return BertEmbedding(config, model.embedding_width)

    return [
        PipelineLayer("embedding", embedding, _embed),
        *_encoder_layers(config, "generator", model.generator),
        PipelineLayer("generator", lambda: GeneratorHead(config), _generator_head),
        PipelineLayer("generator.decoder", embedding, _decoder, tied_to="embedding", tied_weight="word.weight"),
        PipelineLayer("generator.lm_head", lambda: DecoderBias(config), _decoder_bias),
        PipelineLayer("discriminator.embedding", embedding, _embed_replaced, tied_to="embedding",
                      tied_weight="word.weight"),
        *_encoder_layers(config, "discriminator", model.discriminator),
        PipelineLayer("discriminator", lambda: DiscriminatorHead(config), _discriminator_head),
    ]


# ---------------------------------------------------------------------------------------------
# Model, loss and metrics


class ElectraOutputs(NamedTuple):
    generator_logits: torch.Tensor  # [masked, vocab / TP], masked positions in [seq, batch] order
    discriminator_logits: torch.Tensor  # [batch, seq]
    replaced: torch.Tensor  # [batch, seq] bool: the discriminator's labels
    padding_mask: torch.Tensor  # [batch, seq], 1 = real token
    discriminator_weight: torch.Tensor  # λ, a scalar


def electra_loss(outputs: tuple, labels: tuple) -> torch.Tensor:
    """L_MLM + λ·L_disc (paper, eq. 1 and sec. 2): the generator's cross-entropy mean over masked
    tokens, and the discriminator's binary cross-entropy mean over every real token ([CLS], [SEP]
    included, as google-research/electra weights by the input mask and HF's ElectraForPreTraining)."""
    outputs = ElectraOutputs(*outputs)
    targets = labels[0].transpose(0, 1)[labels[0].transpose(0, 1) != IGNORE_INDEX]
    # a copy also in fp32: megatron's cross-entropy works in place on its input, and the generator logits ride
    # past the discriminator's blocks, whose recomputed chunks keep them as inputs (train.activation_checkpoint)
    generator_loss = tensor_parallel.vocab_parallel_cross_entropy(
        outputs.generator_logits.to(torch.float32, copy=True), targets).sum() / max(targets.numel(), 1)
    real = outputs.padding_mask.bool()
    discriminator_loss = F.binary_cross_entropy_with_logits(
        outputs.discriminator_logits.float()[real], outputs.replaced[real].float())
    return generator_loss + outputs.discriminator_weight * discriminator_loss


class ELECTRA(LayeredModel):
    def forward(
        self,
        tokens: torch.Tensor,
        token_types: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        replacement_uniforms: torch.Tensor | None = None,
        evaluation: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | ElectraOutputs:
        """tokens (masked by the collator), token_types, padding_mask (1 = real token), labels (the
        originals at masked positions, -100 elsewhere), replacement_uniforms (float, the sampling
        noise): [batch, seq]. With labels: the loss, or with `evaluation` the ElectraOutputs. Without:
        (generator logits [batch, seq, vocab / TP], discriminator logits [batch, seq]) of the tokens
        as given. Everything runs through forward, so ZeRO-3 gathers what it has registered here."""
        if (labels is None) != (replacement_uniforms is None):
            raise ValueError("ELECTRA trains on labels and replacement_uniforms together (the replaced_token_"
                             "detection collator's batch); pass both, or neither for logits")
        token_types = torch.zeros_like(tokens) if token_types is None else token_types
        padding_mask = torch.ones_like(tokens) if padding_mask is None else padding_mask
        outputs = ElectraOutputs(*self.run_layers(
            (tokens, token_types, padding_mask), labels=labels, replacement_uniforms=replacement_uniforms
        ))
        if labels is None:
            return outputs.generator_logits.transpose(0, 1), outputs.discriminator_logits
        return outputs if evaluation else electra_loss(outputs, (labels,))


def build(config: Config) -> ELECTRA:
    return ELECTRA(pipeline_layers(config), config.train.full_recompute_interval)


AUC_BINS = 4096  # histogram bins of discriminator logits over AUC_LOGIT_RANGE; the ends take the rest
AUC_LOGIT_RANGE = (-16.0, 16.0)


def evaluation_counts(model: ELECTRA, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Counts that sum over batches and data-parallel ranks: the discriminator's accuracy over every
    real token and over the replaced ones (threshold logit 0, probability 1/2), histograms of its
    logits for replaced and original tokens (the AUC, see `histogram_auc`), and the generator's
    masked-token accuracy (full-vocabulary argmax, as BERT's)."""
    with torch.no_grad():
        outputs = model(**batch, evaluation=True)
    real = outputs.padding_mask.bool()
    scores, replaced = outputs.discriminator_logits.float()[real], outputs.replaced[real]
    correct = (scores > 0) == replaced
    labels = batch["labels"].transpose(0, 1)
    targets = labels[labels != IGNORE_INDEX]
    low, high = AUC_LOGIT_RANGE
    bins = ((scores - low) / (high - low) * AUC_BINS).floor().clamp(0, AUC_BINS - 1).long()
    return {
        "val_discriminator_accuracy": (correct.sum(), real.sum()),
        "val_replaced_accuracy": ((correct & replaced).sum(), replaced.sum()),
        "val_discriminator_auc": (torch.bincount(bins[replaced], minlength=AUC_BINS),
                                  torch.bincount(bins[~replaced], minlength=AUC_BINS)),
        "val_generator_masked_accuracy": (
            (vocab_parallel_argmax(outputs.generator_logits.detach()) == targets).sum(),
            torch.tensor(targets.numel(), device=targets.device),
        ),
    }


def histogram_auc(positives: torch.Tensor, negatives: torch.Tensor) -> float:
    """ROC AUC = P(score of a replaced token > score of an original one), ties counted 1/2 (the
    Mann-Whitney U statistic), from score histograms: exact for the binned scores, so off from the
    unbinned AUC by at most half the share of (replaced, original) pairs that fall in one bin
    (bins 1/128 logit wide). Histograms add over batches and ranks where AUCs do not."""
    positives, negatives = positives.double(), negatives.double()
    below = torch.cumsum(negatives, dim=0) - negatives
    pairs = positives.sum() * negatives.sum()
    return float((positives * (below + negatives / 2)).sum() / pairs) if pairs > 0 else float("nan")


def evaluation_values(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: histogram_auc(*value) if name == "val_discriminator_auc" else float(value[0] / value[1])
            for name, value in counts.items()}


# ---------------------------------------------------------------------------------------------
# Counts, validation and the family spec


def _block_params(shape: EncoderShape) -> int:
    hidden, ffn = shape.hidden_size, shape.ffn_size
    return 4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden + ffn  # QKV, output, fc, proj (+ biases), 2 LNs


def _encoder_params(width: int, shape: EncoderShape) -> int:
    projection = width * shape.hidden_size + shape.hidden_size if width != shape.hidden_size else 0
    return projection + shape.num_layers * _block_params(shape)


def counts(config: Config, labelled: float | None = None) -> ModelCounts:
    """Parameters: the shared embedding once (its tables are the embedding parameters), each
    encoder with its E -> width projection, the generator's head (dense, LayerNorm, decoder bias;
    the decoder weight is the word table) and the discriminator's (dense, then one logit): HF's
    ElectraForMaskedLM + ElectraForPreTraining less the ElectraEmbeddings they share.

    FLOPs per sample, forward, times 3 for forward + backward (counts.py): both encoders on every
    token (projection 2·E·h, blocks as BERT's, Kaplan et al. 2020 table 1), the generator's head at
    the m masked positions (2·h_g·E + 2·E·V; `labelled_positions`, or `labelled` per sample of one
    batch) and the discriminator's head on every token (2h² + 2h). Sampling the replacements
    (exp and a cumulative sum over the vocabulary at m positions, no matmul) is elementwise work and
    not counted, like the softmax; no gradient flows through it."""
    model, vocab = config.model, config.padded_vocab_size
    width, seq = model.embedding_width, model.seq_length
    generator, discriminator = model.generator, model.discriminator
    embedding = (vocab + seq + model.type_vocab_size) * width
    generator_head = generator.hidden_size * width + width + 2 * width + vocab
    discriminator_head = discriminator.hidden_size * discriminator.hidden_size + 2 * discriminator.hidden_size + 1
    total = (embedding + 2 * width + _encoder_params(width, generator) + _encoder_params(width, discriminator)
             + generator_head + discriminator_head)
    labelled = labelled_positions(config) if labelled is None else labelled
    per_token = 0
    for shape in (generator, discriminator):
        per_token += 2 * width * shape.hidden_size if width != shape.hidden_size else 0
        per_token += shape.num_layers * transformer_block_flops(shape.hidden_size, shape.ffn_size, seq)
    per_token += 2 * discriminator.hidden_size * discriminator.hidden_size + 2 * discriminator.hidden_size
    sample_flops = seq * per_token + labelled * (2 * generator.hidden_size * width + 2 * width * vocab)
    return ModelCounts(
        total_params=total, embedding_params=embedding, flops_per_token=3.0 * sample_flops / seq,
        flops_formula="3·(Σ over generator and discriminator of [2E·h if E≠h] + l·(8h² + 4h·ffn + 4h·s), "
                      "+ 2h² + 2h (discriminator head) + (m/s)·(2h_g·E + 2E·V)) with m the masked positions "
                      "per sample (Kaplan et al. 2020, table 1)",
    )


def validate(config: Config) -> None:
    refuse_loss_chunking(config, "its generator's logits are made at the masked positions only (about 15% of the "
                                 "tokens) and are sampled from")
    model, tensor = config.model, config.parallel.tensor
    if model.head_dim is not None:
        raise ConfigError(f"model.head_dim={model.head_dim}; ELECTRA's heads are hidden_size / num_heads, "
                          "so leave head_dim unset")
    generator = model.generator
    if min(generator.hidden_size, generator.num_heads, generator.ffn_size, generator.num_layers,
           model.embedding_width) < 1:
        raise ConfigError(f"the generator's shape {generator} and model.embedding_size={model.embedding_size} "
                          "must be at least 1")
    if generator.hidden_size % generator.num_heads:
        raise ConfigError(f"model.generator_hidden_size={generator.hidden_size} is not divisible by "
                          f"model.generator_num_heads={generator.num_heads}; the paper's generators keep 64 per head")
    for name, value in (("generator_num_heads", generator.num_heads), ("generator_ffn_hidden_size",
                                                                        generator.ffn_size)):
        if value % tensor:
            raise ConfigError(f"parallel.tensor={tensor} does not divide model.{name}={value}; "
                              f"use a tensor-parallel size that divides it")


def batch_schema(config: Config) -> BatchSchema:
    return BatchSchema(inputs=("tokens", "token_types", "padding_mask"), labels=("labels", REPLACEMENT_UNIFORMS))
