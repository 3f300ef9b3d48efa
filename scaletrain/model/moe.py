"""Mixture-of-experts MLP layers: a top-k router over expert MLPs, expert capacity, and the auxiliary losses.

A MoE layer stands where a block's MLP stands and sends each token to k of E expert MLPs, so the
parameters grow E-fold while the compute per token grows k-fold (Shazeer et al. 2017; Lepikhin et
al. 2021, GShard; Fedus et al. 2022, Switch Transformers; Jiang et al. 2024, Mixtral):

    router      logits = x W_r (fp32, Switch sec. 2.4 "selective precision"), p = softmax(logits),
                the k experts of largest p; combine weights p renormalised over the k when k > 1
                (GShard, Mixtral), the raw p when k = 1 (Switch eq. 2: the router then learns
                from the main loss too)
    capacity    with `capacity_factor` c each expert takes at most ceil(c · k · T / E) of the T tokens
                it is offered in one forward; first choices before second ones, then in token order
                (GShard's Algorithm 1); a dropped assignment contributes nothing and the token's
                residual carries it on. Without c the layer is dropless.
    aux losses  load balancing α · E · Σ_e f_e · P_e (Switch eq. 4, f_e the share of the k·T
                assignments routed to e before capacity, so a balanced router scores 1 at any k) and
                the router z-loss β · mean_t logsumexp(logits_t)² (Zoph et al. 2022, ST-MoE eq. 5).

The auxiliary losses never enter the activations: each layer adds their gradient in backward
(Megatron-core's MoEAuxLossAutoScaler), so a pipeline stage's MoE layers train them without the
loss travelling between stages, and `loss` stays the language-model loss a dense model reports.
Their gradient is scaled by 1/grad_accum, as DeepSpeed scales the main loss of each micro-batch.
Routing is computed per micro-batch on the rank that holds it: the same in every layout.

Experts are the block kit's ParallelMLP, each split over tensor-parallel ranks like a dense MLP;
the router is replicated (every TP rank routes the same tokens the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.config import bounded
from scaletrain.model.init import InitMethod
from scaletrain.model.layers import ParallelMLP, PartInit
from scaletrain.parallel.expert_parallel import (
    all_to_all,
    exchange_counts,
    expert_parallel_group,
    mark_expert_parameters,
)


@dataclass
class MoEConfig:
    """`model.moe:` of the causal decoders (gpt, llama): which blocks are MoE layers and how they route."""

    num_experts: int = bounded(0, ">= 0", "0: a dense model")  # experts per MoE layer; 0: a dense model
    top_k: int = 2  # experts per token: 1 as Switch (Fedus et al. 2022), 2 as GShard and Mixtral
    # blocks 0, every, 2·every, ... are MoE layers (Megatron's --moe-layer-freq); 1: all
    every: int = bounded(1, ">= 1", "1: every block is a MoE layer")
    # Each expert takes at most ceil(capacity_factor · top_k · tokens / num_experts) assignments per forward
    # on a rank; the rest are dropped (their residual passes on). null: dropless, every assignment computed
    capacity_factor: float | None = bounded(None, "> 0", "or null for dropless routing")
    # load-balancing loss weight (Switch eq. 4; the loss is 1 when balanced)
    aux_loss_coeff: float = bounded(0.01, ">= 0")
    z_loss_coeff: float = bounded(0.001, ">= 0")  # router z-loss weight (Zoph et al. 2022, ST-MoE eq. 5)
    # each expert's hidden size; null: the model's ffn size
    ffn_hidden_size: int | None = bounded(None, ">= 1", "or null for the model's")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.enabled and layer % self.every == 0

    def layer_ffn(self, layer: int, dense_ffn: int) -> int:
        """The hidden size of block `layer`'s MLP: an expert's in a MoE layer, else the dense `dense_ffn`."""
        return (self.ffn_hidden_size or dense_ffn) if self.is_moe_layer(layer) else dense_ffn

    def moe_layers(self, num_layers: int) -> list[int]:
        return [layer for layer in range(num_layers) if self.is_moe_layer(layer)]

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments one expert takes from `num_tokens` tokens; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.top_k * num_tokens / self.num_experts)


def validate_moe(moe: MoEConfig, sequence_parallel: bool) -> list[str]:
    """What is wrong with `model.moe` beyond its keys' ranges (declared with them; each message names the
    key and the fix); empty when nothing is."""
    if not moe.enabled:
        return []
    problems = []
    if not 1 <= moe.top_k <= moe.num_experts:
        problems.append(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}")
    if sequence_parallel:
        problems.append("parallel.sequence_parallel=true with model.moe.num_experts > 0: MoE layers route whole "
                        "sequences; set parallel.sequence_parallel=false")
    return problems


@dataclass(frozen=True)
class Routing:
    """Where a forward's T tokens go: each token's k experts, in order of probability."""

    experts: torch.Tensor  # [T, k] expert ids
    weights: torch.Tensor  # [T, k] combine weights (fp32)
    kept: torch.Tensor  # [T, k] True where the assignment is within its expert's capacity
    probabilities: torch.Tensor  # [T, E] the router's softmax (fp32)
    logits: torch.Tensor  # [T, E] (fp32)
    assigned: torch.Tensor  # [E] assignments the router made to each expert, before capacity (int64)


def route(logits: torch.Tensor, top_k: int, capacity: int | None) -> Routing:
    """Top-k routing of router logits [T, E] (fp32), with the capacity rule of the module docstring."""
    probabilities = logits.softmax(dim=-1)
    top_probabilities, experts = probabilities.topk(top_k, dim=-1)
    weights = top_probabilities / top_probabilities.sum(dim=-1, keepdim=True) if top_k > 1 else top_probabilities
    if capacity is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        choice_major = F.one_hot(experts.t().reshape(-1), logits.shape[-1])  # [k·T, E]: first choices first
        position = (choice_major.cumsum(dim=0) * choice_major).sum(dim=-1) - 1  # its place in its expert's queue
        kept = (position < capacity).reshape(top_k, -1).t()
    assigned = F.one_hot(experts, logits.shape[-1]).sum(dim=(0, 1))  # no bincount: it syncs with the GPU
    return Routing(experts, weights, kept, probabilities, logits, assigned)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch eq. 4 over k assignments per token: E · Σ_e f_e · P_e, with f_e the share of assignments to
    expert e (before capacity: what the router asked for) and P_e the mean router probability of e.
    1 when both are uniform. (transformers' Mixtral loss is k times this: its f sums to k.)"""
    share = routing.assigned.float() / routing.experts.numel()
    return routing.probabilities.shape[-1] * (share * routing.probabilities.mean(dim=0)).sum()


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE eq. 5: the mean squared log-partition of the router logits; keeps them small."""
    return routing.logits.logsumexp(dim=-1).square().mean()


class _AttachAuxiliaryLoss(torch.autograd.Function):
    """Identity on `output`; backward also starts `loss`'s gradient at `scale` (Megatron-core's
    MoEAuxLossAutoScaler): the loss trains its parameters without joining the returned loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


class Router(nn.Module):
    """The replicated gate W_r [E, h]; logits in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, init_method: InitMethod) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        with torch.no_grad():
            init_method(self.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens.float(), self.weight.float())


STATISTICS = ("aux_loss", "z_loss", "assigned", "dropped", "forwards")


class RoutingStatistics:
    """Sums over this rank's training forwards since the last `take()`: the auxiliary losses, the
    assignments per expert and the dropped ones. Ratios of them are what train/hooks/moe.py logs, so
    a forward recomputed under activation checkpointing (counted twice) changes none of them."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._sums: torch.Tensor | None = None

    def add(self, routing: Routing, aux_loss: torch.Tensor, z_loss: torch.Tensor) -> None:
        with torch.no_grad():
            dropped = (~routing.kept).sum().double()
            row = torch.cat([torch.stack([aux_loss.double(), z_loss.double()]), routing.assigned.double(),
                             torch.stack([dropped, torch.ones_like(dropped)])])
            self._sums = row if self._sums is None else self._sums + row

    def take(self, device: torch.device) -> torch.Tensor:
        """[aux_loss, z_loss, assigned per expert..., dropped, forwards] summed, then reset (zeros if none)."""
        sums = self._sums if self._sums is not None else torch.zeros(self.num_experts + 4, dtype=torch.float64)
        self._sums = None
        return sums.to(device)


class MoELayer(nn.Module):
    """A block's MLP as E expert MLPs and a top-k router (the module docstring says how)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        moe: MoEConfig,
        mp_config: ModelParallelConfig,
        init: PartInit,
        *,
        layer_index: int,
        aux_loss_scale: float,
        **mlp_options,
    ) -> None:
        super().__init__()
        self.moe, self.layer_index, self.aux_loss_scale = moe, layer_index, aux_loss_scale
        self.router = Router(hidden_size, moe.num_experts, init("router"))
        # This rank's experts, named by global id (experts.5.fc.weight), so a checkpoint is the same
        # whatever the expert-parallel size; every expert is initialised from its own name's seed.
        self.expert_group = expert_parallel_group()
        self.experts = nn.ModuleDict({
            str(expert): ParallelMLP(hidden_size, ffn_hidden_size, mp_config,
                                     lambda part, expert=expert: init(f"experts.{expert}.{part}"), **mlp_options)
            for expert in self.expert_group.local_experts(moe.num_experts)
        })
        if self.expert_group.size > 1:
            mark_expert_parameters(self.experts)
        self.num_experts = moe.num_experts  # DeepSpeed's name for it (upstream.expert_parallel_engine)
        self.statistics = RoutingStatistics(moe.num_experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [seq, batch, h]; tokens are routed in sample order (batch-major) for capacity priority."""
        seq_length, batch_size, hidden_size = hidden.shape
        tokens = hidden.transpose(0, 1).reshape(-1, hidden_size)
        routing = route(self.router(tokens), self.moe.top_k, self.moe.capacity(tokens.shape[0]))
        output = self._combine(tokens, routing)
        output = output.reshape(batch_size, seq_length, hidden_size).transpose(0, 1)
        if self.training:
            aux_loss, z_loss = load_balancing_loss(routing), router_z_loss(routing)
            self.statistics.add(routing, aux_loss.detach(), z_loss.detach())
            penalty = self.moe.aux_loss_coeff * aux_loss + self.moe.z_loss_coeff * z_loss
            if penalty.requires_grad:
                output = _AttachAuxiliaryLoss.apply(output, penalty, self.aux_loss_scale)
        return output

    def _combine(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Σ over a token's kept assignments of weight · expert(token).

        The kept assignments, ordered by expert, go to the ranks holding their experts (an identity
        without expert parallelism; parallel/expert_parallel.py), each expert runs on the rows it
        received from every rank, and the outputs come back in the order they left. Every local
        expert runs, with no rows if none came: its tensor-parallel collectives and ZeRO-3's gathers
        happen on every step alike."""
        group, num_experts = self.expert_group, self.moe.num_experts
        token_of = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(self.moe.top_k)
        kept = routing.kept.reshape(-1).nonzero().squeeze(-1)
        expert_of, order = routing.experts.reshape(-1)[kept].sort(stable=True)
        assignments = kept[order]  # by expert, then token order (k choices per token)
        per_expert = F.one_hot(expert_of, num_experts).sum(dim=0)
        received = exchange_counts(per_expert, group)  # [source rank, local expert]
        send_counts = per_expert.reshape(group.size, -1).sum(dim=1).tolist()
        receive_counts = received.sum(dim=1).tolist()
        rows = all_to_all(tokens[token_of[assignments]], send_counts, receive_counts, group)
        # received rows come source by source, each source's by expert: regroup them by expert
        local_expert_of_row = torch.arange(received.shape[1], device=tokens.device).repeat(group.size)
        by_expert = local_expert_of_row.repeat_interleave(received.reshape(-1)).argsort(stable=True)
        # megatron's linears take [seq, batch, h]: each expert's rows as a batch of one
        outputs = [expert(chunk.unsqueeze(1)).squeeze(1)
                   for expert, chunk in zip(self.experts.values(), rows[by_expert].split(received.sum(dim=0).tolist()),
                                            strict=True)]
        in_expert_order = torch.cat(outputs)
        expert_rows = in_expert_order.new_empty(in_expert_order.shape).index_copy(0, by_expert, in_expert_order)
        returned = all_to_all(expert_rows, receive_counts, send_counts, group)
        weights = routing.weights.reshape(-1)[assignments, None].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, token_of[assignments], returned * weights)


def moe_layers_of(module: nn.Module) -> list[MoELayer]:
    """The MoE layers this process holds (a pipeline stage holds its own), in module order."""
    return [child for child in module.modules() if isinstance(child, MoELayer)]


def block_mlp(
    moe: MoEConfig,
    layer: int,
    hidden_size: int,
    ffn_hidden_size: int,
    mp_config: ModelParallelConfig,
    init: PartInit,
    grad_accum: int,
    **mlp_options,
) -> nn.Module:
    """Block `layer`'s MLP: a MoELayer where `moe` puts one (experts of moe.layer_ffn), else the dense
    ParallelMLP of `ffn_hidden_size`; `mlp_options` (activation, gated, bias) shape both."""
    ffn = moe.layer_ffn(layer, ffn_hidden_size)
    if not moe.is_moe_layer(layer):
        return ParallelMLP(hidden_size, ffn, mp_config, init, **mlp_options)
    return MoELayer(hidden_size, ffn, moe, mp_config, init, layer_index=layer, aux_loss_scale=1.0 / grad_accum,
                    **mlp_options)
