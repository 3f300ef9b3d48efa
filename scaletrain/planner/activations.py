"""Activation memory of our GPT: bytes saved for backward, per block and per pipeline stage.

Follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sec. 4.1-4.2. Per block and micro-batch, with 16-bit activations and 1-byte dropout masks:
    s*b*h*(34 + 5*a*s/h)                   no parallelism,
    s*b*h*(10 + 24/t + 5*a*s/(h*t))        tensor parallelism t, no sequence parallelism,
    s*b*h*(34 + 5*a*s/h) / t               tensor + sequence parallelism,
    2*s*b*h                                full recomputation (only the block input is kept),
    s*b*h*(10 + 24/t)                      selective recomputation (sec. 4.3: the attention core's
                                           5as/(ht) is recomputed, everything else kept; 34 at t = 1).
We keep their grouping but count each tensor in its real dtype, which is what lets the formula
be checked against a CPU fp32 run (tests/planner/test_memory.py):
- replicated (their 10 bytes): LayerNorm inputs and outputs, 4 tensors of s*b*h, plus the two
  hidden dropout masks when dropout > 0;
- split by TP (their 24 bytes): the QKV output (3h; the math kernel keeps copies of q, k and v
  instead, the same size), the attention output = the output projection's input (h), the fc
  output = GELU input (ffn) and the GELU output (ffn);
- attention (their 5as/h): "math" attention keeps the s x s softmax, plus its dropout mask and
  output when dropout > 0; "flash" (SDPA's flash / memory-efficient kernels, which our model uses
  on GPU, and the CPU kernel when dropout = 0) keeps only a fp32 logsumexp per head and row;
- LayerNorm mean and rstd (fp32, 2 per norm), which the paper omits as small.
An explicit attention mask (model/attention_masks.py: document masking, or a sliding window narrower
than the sequence; plain causal attention uses SDPA's is_causal and has none) costs a fused kernel one
more tensor: SDPA turns the boolean mask into an additive one of the activation dtype and keeps it for
backward, [b, 1, s, s] for documents (one per sequence) or [s, s] for a window alone, per block and
replicated over TP ranks (measured on CPU; CUDA's memory-efficient kernel, the one that takes a mask,
keeps its attention bias the same way). The math kernel adds the mask to the scores and keeps nothing.
FlexAttention (model.attention_backend flex, or auto on a GPU without attention dropout or context
parallelism: model/decoder.py) replaces that mask by a block mask built once per micro-batch and shared by the
blocks, int32 tile indices of [b, 1, s/128, s/128] (kilobytes: counted as none), and keeps a logsumexp as
the fused kernels do; the planner plans GPUs, so `auto` counts as flex where those conditions hold.
The attention output needs no copy of its own: SDPA returns it in the query's [s, b, heads, d]
memory layout, so the reshape for the output projection is a view (measured on CPU; a kernel
that returned another layout would add s*b*h/t per block).
Hidden dropout masks are bool (1 byte) in CUDA's fused dropout but tensors of the activation
dtype in the CPU fallback; `dropout_mask_bytes` says which. At dropout = 0 nothing is stored.

Selective recomputation (model/layers.py ParallelAttention) runs the core, softmax(QK^T)V, under a
checkpoint that keeps its inputs: q, k, v (the QKV output, already counted) and the mask the block
passes in, a boolean [b, 1, s, s] under document masking (1 byte; a window's mask is built inside the
core and recomputed). It frees the attention term (the s x s softmax, dropout mask and output of the math
kernel, or a fused kernel's logsumexp) and the additive mask a fused kernel keeps; the attention output
stays, as the output projection's input. Backward rebuilds one core at a time, so one block's attention
term and additive mask are an extra working set at the peak.

Outside the blocks: the first stage keeps the token and position ids (and, at TP > 1, the
vocab-parallel embedding's out-of-shard mask); the last stage keeps the final LayerNorm's input,
statistics and output, and the vocab-parallel cross-entropy keeps exp(logits) in fp32, s*b*V/t.

Sequence parallelism (Korthikanti sec. 4.2.2; scaletrain/parallel/sequence_parallel.py) divides
everything replicated by t: LayerNorm inputs, outputs and statistics, hidden dropout masks, the
embedding's dropout mask (megatron drops after the scatter) and the final LayerNorm. The
column-parallel linears all-gather their input along the sequence, but megatron's
`LinearWithGradAccumulationAndAsyncCommunication` saves the un-gathered shard (the LayerNorm
output, already counted) and gathers it again in backward; the gathered copy sits in megatron's
global buffer, reused by every layer, so it adds nothing per block. The same holds for the tied
output layer. Measured per rank at TP=2 on a megatron-built block (tests/planner/test_memory.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from scaletrain.config import ModelConfig

ATTENTION_KERNELS = ("flash", "math")
INDEX_BYTES = 8  # token ids and targets are int64
STATISTIC_BYTES = 4  # LayerNorm mean/rstd and attention logsumexp are fp32 even for bf16 inputs


class Recompute(enum.IntEnum):
    """What backward recomputes (train.activation_checkpoint). An int whose false value recomputes nothing and
    whose 1 is full, so the bool a layout's recompute was (True: full) keeps its meaning."""

    NONE = 0
    FULL = 1  # every block from its input (Korthikanti et al. 2022, sec. 4.2)
    SELECTIVE = 2  # each block's attention core (sec. 4.3)

    @property
    def setting(self) -> str:
        """Its train.activation_checkpoint value."""
        return self.name.lower()


# cheapest in time first, least memory last: the order `auto` tries them in and the planner breaks ties by
RECOMPUTE_BY_COST = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


@dataclass(frozen=True)
class ActivationSettings:
    """What the kernels store: activation dtype, dropout mask dtype, attention kernel, SP."""

    activation_bytes: int = 2
    dropout_mask_bytes: int = 1
    attention: str = "flash"
    sequence_parallel: bool = False  # megatron's SP (ModelParallelConfig.sequence_parallel), t > 1 only
    block_mask: bool = False  # FlexAttention's block mask instead of a dense one (flex_attention_planned)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {self.attention!r} is unknown; use one of {ATTENTION_KERNELS}")

    def sequence_split(self, tensor_parallel: int) -> int:
        """How many ways the replicated activations are split: t under sequence parallelism, else 1."""
        return tensor_parallel if self.sequence_parallel else 1


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one transformer block saves for backward for one micro-batch, grouped as in the paper."""

    replicated: float
    split: float
    attention: float
    norm_statistics: float
    attention_mask: float = 0.0

    @property
    def total(self) -> float:
        return self.replicated + self.split + self.attention + self.norm_statistics + self.attention_mask


@dataclass(frozen=True)
class StageActivations:
    """Bytes one micro-batch keeps on one pipeline stage, and the extra working set of recomputation."""

    stored: float
    recompute_working_set: float = 0.0

    @property
    def peak(self) -> float:
        return self.stored + self.recompute_working_set


def block_activations(
    model: ModelConfig, micro_batch: int, tensor_parallel: int, settings: ActivationSettings
) -> BlockActivations:
    """One block without recomputation (Korthikanti et al. 2022, sec. 4.1, eq. 1-2)."""
    tokens = model.seq_length * micro_batch
    hidden, act = model.hidden_size, settings.activation_bytes
    sequence_split = settings.sequence_split(tensor_parallel)
    masks = 2 * settings.dropout_mask_bytes if model.dropout > 0 else 0
    heads = model.num_heads / tensor_parallel
    if settings.attention == "flash":
        attention = heads * tokens * STATISTIC_BYTES
    else:
        dropped = settings.dropout_mask_bytes + act if model.dropout > 0 else 0
        attention = heads * model.seq_length * tokens * (act + dropped)
    return BlockActivations(
        replicated=tokens * hidden * (4 * act + masks) / sequence_split,
        split=tokens * (4 * hidden + 2 * model.ffn_size) * act / tensor_parallel,
        attention=attention,
        norm_statistics=2 * 2 * tokens * STATISTIC_BYTES / sequence_split,
        attention_mask=attention_mask_bytes(model, micro_batch, settings),
    )


def attention_mask_bytes(model: ModelConfig, micro_batch: int, settings: ActivationSettings) -> float:
    """The additive mask a fused kernel keeps per block (module docstring). The keys are the causal
    decoders' (model/decoder.py DecoderConfig), so other families' sections have none."""
    if settings.attention != "flash" or settings.block_mask:
        return 0.0
    seq = model.seq_length
    if getattr(model, "document_masking", False):
        return micro_batch * seq * seq * settings.activation_bytes
    window = getattr(model, "sliding_window", None)
    return seq * seq * settings.activation_bytes if window is not None and window < seq else 0.0


def flex_attention_planned(model: ModelConfig, context: int = 1) -> bool:
    """Whether a decoder's training forwards attend through FlexAttention block masks on a GPU: model/decoder.py's
    attention_backend as it resolves on CUDA (flex; auto without attention dropout or context parallelism)."""
    backend = getattr(model, "attention_backend", "sdpa")
    return backend == "flex" or (backend == "auto" and model.dropout == 0 and context == 1)


def selective_block_activations(model: ModelConfig, micro_batch: int, block: BlockActivations,
                                settings: ActivationSettings) -> BlockActivations:
    """What a block keeps when its attention core is recomputed (module docstring): no attention term and
    no additive mask, but the boolean document mask the core's checkpoint keeps as an input (a block mask
    under FlexAttention, counted as none)."""
    documents = getattr(model, "document_masking", False) and not settings.block_mask
    return replace(block, attention=0.0,
                   attention_mask=micro_batch * model.seq_length * model.seq_length if documents else 0.0)


def stage_activations(
    model: ModelConfig,
    vocab_size: int,
    micro_batch: int,
    tensor_parallel: int,
    layers: int,
    first_stage: bool,
    last_stage: bool,
    recompute: Recompute,
    settings: ActivationSettings,
) -> StageActivations:
    """Activations of one micro-batch on a stage of `layers` blocks.

    With full recomputation each block keeps only its input (Korthikanti sec. 4.2: 2sbh at
    16 bits), and backward rebuilds one block at a time, so one block's activations are an
    extra working set at the peak; with selective recomputation, one block's attention core
    (module docstring).
    """
    tokens = model.seq_length * micro_batch
    sequence_split = settings.sequence_split(tensor_parallel)
    block = block_activations(model, micro_batch, tensor_parallel, settings)
    if recompute == Recompute.FULL:
        per_block = tokens * model.hidden_size * settings.activation_bytes / sequence_split
        stored, working_set = layers * per_block, block.total
    elif recompute == Recompute.SELECTIVE:
        kept = selective_block_activations(model, micro_batch, block, settings)
        stored, working_set = layers * kept.total, block.attention + block.attention_mask
    else:
        stored, working_set = layers * block.total, 0.0
    if first_stage:
        stored += _embedding_activations(model, micro_batch, tensor_parallel, settings)
    if last_stage:
        stored += _output_activations(model, vocab_size, micro_batch, tensor_parallel, settings)
    return StageActivations(stored=stored, recompute_working_set=working_set)


def _embedding_activations(
    model: ModelConfig, micro_batch: int, tensor_parallel: int, settings: ActivationSettings
) -> float:
    tokens = model.seq_length * micro_batch
    sequence_split = settings.sequence_split(tensor_parallel)
    stored = tokens * INDEX_BYTES + model.seq_length * INDEX_BYTES
    if tensor_parallel > 1:
        stored += tokens  # bool mask of ids outside this rank's vocabulary shard
    if model.dropout > 0:
        stored += tokens * model.hidden_size * settings.dropout_mask_bytes / sequence_split
    return stored


def _output_activations(
    model: ModelConfig, vocab_size: int, micro_batch: int, tensor_parallel: int, settings: ActivationSettings
) -> float:
    tokens = model.seq_length * micro_batch
    sequence_split = settings.sequence_split(tensor_parallel)
    final_norm = (2 * model.hidden_size * settings.activation_bytes + 2 * STATISTIC_BYTES) / sequence_split
    cross_entropy = vocab_size // tensor_parallel * 4 + 1 + INDEX_BYTES  # fp32 exp(logits), mask, target
    return tokens * (final_norm + cross_entropy)
