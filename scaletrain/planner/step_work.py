"""The work of one micro-batch on one GPU: its GEMM shapes, flash attention's FLOPs and the memory-bound bytes.

step_time.py times each piece on a device (kernel_time.py); this module only says what the pieces are,
from the config as the family's own FLOPs count (model/counts.py) sees the model. Tokens T = micro-batch x
seq / CP are the rows (m) of every GEMM (megatron's [s, b, h] activations flatten to [T, h]); n is a weight's
columns on this TP rank and k its reduction dimension (column-parallel in, row-parallel out: Shoeybi et al.
2019, sec. 3). Per block, forward:
    query/key/value  [T, h] x [h, (n_q + 2 n_kv) d / t]  one GEMM for multi-head attention, two (query,
                     key_value) for grouped-query attention (model/layers.py); key/value heads that TP does
                     not divide are replicated, [h, 2 n_kv d] on every rank
    output           [T, n_q d / t] x [n_q d / t, h]
    fc               [T, h] x [h, g f / t]    g = 2 for a gated MLP (SwiGLU, gated GELU: [gate; up] is one
                     GEMM, model/layers.py ParallelMLP), else 1
    proj             [T, f / t] x [f / t, h]
and once per micro-batch, on the last stage, the output layer [T, h] x [h, V / t]. A MoE layer (model/moe.py)
adds the router [T, h] x [h, E] and runs fc and proj on the top_k T token copies, spread evenly over the E
experts (balanced and dropless: capacity drops only remove work), E / EP experts on a rank. Whether the MLP
is gated is read off the family's count (`mlp_gates`): the config has no key for it. Backward runs two GEMMs
per forward one, the input gradient dX = dY W^T, (m, k, n), and the weight gradient dW^T = X^T dY, (k, n, m):
twice the forward FLOPs (Narayanan et al. 2021, eq. 3).

Attention scores and values: 4 T s n_q d / t FLOPs forward, over the full s x s square as the family's count
has them (Kaplan et al. 2020, table 1); a causal flash kernel computes about half the square, and its backward
executes 2.5x its forward, 5 matmuls against 2 as it recomputes the scores (Dao 2023, FlashAttention-2,
sec. 4.1).

Memory-bound passes, in activation-dtype elements per token, forward (backward reads the saved input and the
incoming gradient and writes the input's gradient, and the residual stream's gradients are summed: counted
as 2x forward):
- each vector parameter of the block on this rank (a bias, a norm's gain or shift) is applied to a column of
  T: read and written (a LayerNorm's gain and shift are one fused pass, so this counts a LayerNorm twice);
- two residual adds: read two, write one, 3h each;
- the MLP's activation: read fc's g f / t outputs, write f / t;
- with dropout, the two hidden dropouts read and write h each.
Outside the blocks: megatron's vocab-parallel cross-entropy in fp32 over the [T, V / t] logits,
`LOSS_BYTES_PER_LOGIT`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.families import objective_kind
from scaletrain.planner.activations import ActivationSettings, attention_mask_bytes, flex_attention_planned
from scaletrain.planner.flops import blocks_forward_flops_per_token
from scaletrain.planner.params import model_parameters, num_blocks

# megatron's vocab_parallel_cross_entropy: forward reads the bf16 logits and writes them in fp32 (2 + 4),
# reads them for the max, and again to write exp and sum it (4 + 4 + 4); backward reads exp and writes the
# fp32 gradient (4 + 4), which the output layer reads as bf16 after a cast (4 + 2)
LOSS_BYTES_PER_LOGIT = 32


@dataclass(frozen=True)
class Gemm:
    """`count` matrix multiplies [m, k] x [k, n]."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count

    def backward(self) -> tuple[Gemm, Gemm]:
        """The input gradient dY W^T and the weight gradient X^T dY."""
        return (Gemm(f"{self.name} dgrad", self.m, self.k, self.n, self.count),
                Gemm(f"{self.name} wgrad", self.k, self.n, self.m, self.count))


@dataclass(frozen=True)
class Attention:
    """One block's attention scores and values on this rank: `heads` of `head_dim` for `queries` x `keys`."""

    batch: int
    heads: int
    queries: int
    keys: int
    head_dim: int
    causal: bool  # the kernel skips the masked half of the square

    @property
    def flops(self) -> int:
        """Forward FLOPs over the full square, as model FLOPs count them."""
        return 4 * self.batch * self.heads * self.queries * self.keys * self.head_dim

    @property
    def executed_forward_flops(self) -> float:
        return self.flops / 2 if self.causal else self.flops


@dataclass(frozen=True)
class BlockWork:
    """One block's forward for one micro-batch on one GPU; its backward is derived (module docstring)."""

    gemms: tuple[Gemm, ...]
    attention: Attention
    elementwise_bytes: float

    @property
    def flops(self) -> int:
        return sum(gemm.flops for gemm in self.gemms) + self.attention.flops


def block_work(config: Config, layer: int, micro_batch: int, tensor: int, expert: int = 1, context: int = 1,
               activation_bytes: int = 2) -> BlockWork:
    model = config.model
    tokens = micro_batch * model.seq_length // context
    gemms = (*attention_gemms(config, tokens, tensor), *mlp_gemms(config, layer, tokens, tensor, expert))
    heads = model.num_heads // tensor
    attention = Attention(micro_batch, heads, model.seq_length // context, model.seq_length,
                          model.attention_head_dim, causal_kernel(config, context))
    return BlockWork(gemms, attention, tokens * activation_bytes * _elementwise_per_token(config, layer, tensor))


def attention_gemms(config: Config, tokens: int, tensor: int) -> tuple[Gemm, ...]:
    model = config.model
    hidden, inner = model.hidden_size, model.num_heads * model.attention_head_dim
    kv_inner = 2 * model.num_query_groups * model.attention_head_dim
    output = Gemm("attention output", tokens, hidden, inner // tensor)
    if model.num_query_groups == model.num_heads:
        return Gemm("qkv", tokens, (inner + kv_inner) // tensor, hidden), output
    kv_columns = kv_inner // tensor if model.num_query_groups % tensor == 0 else kv_inner
    return Gemm("query", tokens, inner // tensor, hidden), Gemm("key_value", tokens, kv_columns, hidden), output


def mlp_gemms(config: Config, layer: int, tokens: int, tensor: int, expert: int = 1) -> tuple[Gemm, ...]:
    model, gates = config.model, mlp_gates(config)
    moe = getattr(model, "moe", None)
    if moe is None or not moe.is_moe_layer(layer):
        ffn = model.ffn_size // tensor
        return Gemm("fc", tokens, gates * ffn, model.hidden_size), Gemm("proj", tokens, model.hidden_size, ffn)
    ffn = moe.layer_ffn(layer, model.ffn_size) // tensor
    rows = math.ceil(moe.top_k * tokens * expert / moe.num_experts)  # each expert's routed token copies
    experts = moe.num_experts // expert
    return (Gemm("router", tokens, moe.num_experts, model.hidden_size),
            Gemm("expert fc", rows, gates * ffn, model.hidden_size, experts),
            Gemm("expert proj", rows, model.hidden_size, ffn, experts))


def output_layer_gemm(config: Config, micro_batch: int, tensor: int, context: int = 1) -> Gemm:
    tokens = micro_batch * config.model.seq_length // context
    return Gemm("output layer", tokens, config.padded_vocab_size // tensor, config.model.hidden_size)


def loss_bytes(config: Config, micro_batch: int, tensor: int, context: int = 1) -> float:
    """The fp32 cross-entropy's HBM traffic over this rank's logits, forward and backward."""
    logits = output_layer_gemm(config, micro_batch, tensor, context)
    return logits.m * logits.n * LOSS_BYTES_PER_LOGIT


def causal_kernel(config: Config, context: int = 1) -> bool:
    """A causal LM without an explicit mask runs SDPA's is_causal kernel, which skips the masked half, and so
    does FlexAttention's block mask, which skips every fully masked tile (documents and windows skip more:
    counted as causal); SDPA with a prefix LM's, documents' or a window's mask, or a bidirectional encoder,
    computes the whole square."""
    if objective_kind(config) != "causal_lm":
        return False
    return flex_attention_planned(config.model, context) or \
        not attention_mask_bytes(config.model, 1, ActivationSettings())


def mlp_gates(config: Config) -> int:
    """2 for a gated MLP, else 1, from the family's count: its blocks' forward FLOPs per token less attention
    and routers are (1 + g) x 2 h f per MLP (x top_k in a MoE layer). A family whose blocks hold more than a
    decoder block (T5's and BART's cross-attention) gives a ratio between; it is rounded into 1 or 2, and
    step_time.py scales such blocks to their counted FLOPs."""
    key = _model_key(config)
    if key not in _GATES:
        _GATES[key] = _counted_gates(config)
    return _GATES[key]


def _counted_gates(config: Config) -> int:
    model = config.model
    moe = getattr(model, "moe", None)
    attention = sum(gemm.flops for gemm in attention_gemms(config, 1, 1)) + 4 * model.seq_length * \
        model.num_heads * model.attention_head_dim
    mlps = routers = 0
    for layer in range(num_blocks(config)):
        routed = moe is not None and moe.is_moe_layer(layer)
        ffn = moe.layer_ffn(layer, model.ffn_size) if routed else model.ffn_size
        mlps += 2 * model.hidden_size * ffn * (moe.top_k if routed else 1)
        routers += 2 * model.hidden_size * moe.num_experts if routed else 0
    counted = blocks_forward_flops_per_token(config) - num_blocks(config) * attention - routers
    return min(max(round(counted / mlps) - 1, 1), 2)


def blocks_flops_scale(config: Config) -> float:
    """The family's counted block FLOPs over those of `block_work`: 1 for a decoder (gpt, llama, their MoE
    variants); above 1 where blocks hold more (cross-attention), whose time is scaled by it."""
    key = _model_key(config)
    if key not in _SCALES:
        modelled = sum(work.flops * count for work, count in stage_blocks(config, range(num_blocks(config)), 1, 1))
        _SCALES[key] = blocks_forward_flops_per_token(config) * config.model.seq_length / modelled
    return _SCALES[key]


def stage_blocks(config: Config, layers: range, micro_batch: int, tensor: int, expert: int = 1, context: int = 1,
                 activation_bytes: int = 2) -> list[tuple[BlockWork, int]]:
    """The distinct blocks among `layers` and how many of each: a dense block and, in a MoE model, a MoE one."""
    moe = getattr(config.model, "moe", None)
    kinds: dict[bool, list[int]] = {}
    for layer in layers:
        kinds.setdefault(moe is not None and moe.is_moe_layer(layer), []).append(layer)
    return [(block_work(config, same[0], micro_batch, tensor, expert, context, activation_bytes), len(same))
            for same in kinds.values()]


# Keyed by what the model's shapes depend on, as params.py keys its counts (Config is unhashable).
_GATES: dict[str, int] = {}
_SCALES: dict[str, float] = {}


def _model_key(config: Config) -> str:
    return repr((config.model, config.data.vocab_size, config.objective))


def _elementwise_per_token(config: Config, layer: int, tensor: int) -> float:
    """Activation elements read and written per token by one block's forward (module docstring)."""
    model = config.model
    block = [counted for counted in model_parameters(config).layers if counted.is_block][layer]
    vectors = block.count(tensor).vectors - block.count(tensor, experts_only=True).vectors
    fc, proj = (gemm for gemm in mlp_gemms(config, layer, 1, tensor) if gemm.name.endswith(("fc", "proj")))
    moe = getattr(model, "moe", None)
    copies = moe.top_k if moe is not None and moe.is_moe_layer(layer) else 1
    dropouts = 2 * 2 * model.hidden_size if model.dropout > 0 else 0
    return 2 * vectors + 2 * 3 * model.hidden_size + copies * (fc.n + proj.k) + dropouts


def gemm_shapes_for(configs: Iterable[Config], micro_batches: Iterable[int] = (1, 2, 4, 8, 16),
                    tensor: int = 1) -> list[tuple[int, int, int]]:
    """The (m, n, k) shapes worth measuring for these models: every block's forward, input- and
    weight-gradient GEMMs and the output layer's, at each micro-batch, sorted, each once."""
    shapes = set()
    micro_batches = tuple(micro_batches)
    for config in configs:
        for micro_batch in micro_batches:
            gemms = [output_layer_gemm(config, micro_batch, tensor)]
            for work, _ in stage_blocks(config, range(num_blocks(config)), micro_batch, tensor):
                gemms.extend(work.gemms)
            shapes.update((g.m, g.n, g.k) for gemm in gemms for g in (gemm, *gemm.backward()))
    return sorted(shapes)


def attention_shapes_for(configs: Iterable[Config], micro_batches: Iterable[int] = (1, 2, 4, 8, 16),
                         tensor: int = 1) -> list[Attention]:
    """The flash-attention calls worth measuring for these models (kernel_time.measure_attention_table)."""
    micro_batches = tuple(micro_batches)
    calls = {block_work(config, 0, micro_batch, tensor).attention
             for config in configs for micro_batch in micro_batches}
    return sorted(calls, key=lambda call: (call.head_dim, call.keys, call.batch * call.heads, call.causal))
