"""Mixture-of-experts layers (model/moe.py): routing and capacity by hand, the auxiliary losses against
their papers' formulas and transformers' Mixtral loss, the layer against a per-token reference, the
auxiliary losses' gradient, TP2 = TP1, and the routing metrics."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model
from scaletrain.model.moe import (
    MoEConfig,
    MoELayer,
    RoutingStatistics,
    load_balancing_loss,
    route,
    router_z_loss,
)
from scaletrain.model.parallel_config import model_parallel_config
from scaletrain.train.hooks.moe import routing_metrics
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks


def test_top_k_routing_picks_the_most_probable_experts_and_renormalises_their_weights():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 2.5]])
    routing = route(logits, top_k=2, capacity=None)
    assert routing.experts.tolist() == [[0, 2], [1, 3]]
    probabilities = logits.softmax(-1)
    expected = probabilities.gather(1, routing.experts)
    assert torch.allclose(routing.weights, expected / expected.sum(-1, keepdim=True))
    assert routing.kept.all()


def test_switch_routing_weights_a_token_by_its_raw_probability():
    """k = 1: renormalising would make every weight 1 and leave the router no gradient from the loss."""
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, -1.0, 0.5]])
    routing = route(logits, top_k=1, capacity=None)
    assert routing.experts.squeeze(1).tolist() == [0, 2]
    assert torch.allclose(routing.weights.squeeze(1), logits.softmax(-1).max(-1).values)


def test_capacity_takes_first_choices_before_second_ones_then_token_order():
    """Each expert has room for 2. All first choices queue before any second choice (GShard's
    Algorithm 1), each group in token order."""
    # first choices: 0, 0, 0, 1; second choices: 1, 1, 2, 2
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0]])
    routing = route(logits, top_k=2, capacity=2)
    assert routing.experts.tolist() == [[0, 1], [0, 1], [0, 2], [1, 2]]
    # expert 0's queue: t0, t1, t2 (t2 dropped); expert 1's: t3 (first choice), then t0, t1 (t1 dropped);
    # expert 2's: t2, t3
    assert routing.kept.tolist() == [[True, True], [True, False], [False, True], [True, True]]


def test_capacity_is_the_papers_formula():
    moe = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25)
    assert moe.capacity(100) == math.ceil(1.25 * 2 * 100 / 8) == 32
    assert MoEConfig(num_experts=8).capacity(100) is None


def test_load_balancing_loss_is_one_when_balanced_and_k_times_less_than_transformers_mixtral():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    # every expert equally likely and equally chosen: 1 (Switch eq. 4's minimum)
    balanced = route(torch.zeros(8, 4) + torch.eye(4).repeat(2, 1) * 1e-3, top_k=1, capacity=None)
    assert load_balancing_loss(balanced).item() == pytest.approx(1.0, abs=1e-3)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 2
    for top_k in (1, 2, 3):
        ours = load_balancing_loss(route(logits, top_k, None)).item()
        assert load_balancing_loss_func((logits,), 8, top_k).item() == pytest.approx(top_k * ours, rel=1e-6)
    # all tokens to one expert that also has all the probability: E
    collapsed = route(torch.tensor([[20.0, 0.0, 0.0, 0.0]]).repeat(16, 1), top_k=1, capacity=None)
    assert load_balancing_loss(collapsed).item() == pytest.approx(4.0, rel=1e-6)


def test_router_z_loss_is_the_mean_squared_log_partition():
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    expected = sum(math.log(sum(math.exp(x) for x in row)) ** 2 for row in logits.tolist()) / 10
    assert router_z_loss(route(logits, 2, None)).item() == pytest.approx(expected, rel=1e-6)


def _layer(moe: MoEConfig, hidden: int = 16, ffn: int = 24, seed: int = 0, aux_loss_scale: float = 1.0) -> MoELayer:
    from scaletrain.config import Config

    def init(part: str):
        generator = torch.Generator().manual_seed(seed + zlib.crc32(part.encode()))
        return lambda tensor: torch.nn.init.normal_(tensor, std=0.3, generator=generator)

    mp_config = model_parallel_config(Config())
    return MoELayer(hidden, ffn, moe, mp_config, init, layer_index=0, aux_loss_scale=aux_loss_scale,
                    activation=F.silu, gated=True, bias=False)


def _reference(layer: MoELayer, hidden: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Token by token in sample order: Σ over its kept choices of weight · SwiGLU expert (plain matmuls)."""
    seq, batch, width = hidden.shape
    tokens = hidden.transpose(0, 1).reshape(-1, width)
    routing = route(F.linear(tokens, layer.router.weight), layer.moe.top_k, capacity)
    output = torch.zeros_like(tokens)
    for token in range(tokens.shape[0]):
        for choice in range(layer.moe.top_k):
            if not routing.kept[token, choice]:
                continue
            expert = layer.experts[str(int(routing.experts[token, choice]))]
            gate, up = F.linear(tokens[token], expert.fc.weight).chunk(2)
            output[token] += routing.weights[token, choice] * F.linear(F.silu(gate) * up, expert.proj.weight)
    return output.reshape(batch, seq, width).transpose(0, 1)


def _layer_against_reference() -> dict:
    hidden = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, moe in {"dropless": MoEConfig(num_experts=4, top_k=2),
                      "capacity": MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5)}.items():
        layer = _layer(moe).eval()
        capacity = moe.capacity(15)
        results[name] = (layer(hidden), _reference(layer, hidden, capacity),
                         route(layer.router(hidden.transpose(0, 1).reshape(-1, 16)), 2, capacity).kept)
    return results


def _single_rank_checks(rank: int, world_size: int) -> dict:
    """One rank (megatron's linears need its parallel state) for every check of a lone layer."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return {"reference": _layer_against_reference(), "gradients": _auxiliary_gradient()}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    return run_on_ranks(_single_rank_checks, 1)[0]


def test_layer_computes_each_tokens_weighted_experts_and_drops_past_capacity(single_rank: dict):
    results = single_rank["reference"]
    for name, (ours, reference, _) in results.items():
        assert torch.allclose(ours, reference, atol=1e-5), name
    assert results["dropless"][2].all()
    assert 0 < (~results["capacity"][2]).sum() < results["capacity"][2].numel()  # some dropped, not all


def _auxiliary_gradient() -> dict:
    moe = MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    hidden = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(3))
    gradients = {}
    for attached in (True, False):
        layer = _layer(moe, aux_loss_scale=0.5).train()
        output = layer(hidden)
        loss = output.square().sum()
        if not attached:  # what the attached penalty should add: 0.5 x (a·L_aux + b·L_z), explicitly
            layer.eval()
            routing = route(layer.router(hidden.transpose(0, 1).reshape(-1, 16)), 2, None)
            loss = layer(hidden).square().sum() + 0.5 * (0.3 * load_balancing_loss(routing)
                                                         + 0.05 * router_z_loss(routing))
        loss.backward()
        gradients[attached] = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return gradients


def test_auxiliary_losses_reach_the_router_scaled_without_joining_the_output(single_rank: dict):
    gradients = single_rank["gradients"]
    for name, grad in gradients[False].items():
        assert torch.allclose(gradients[True][name], grad, atol=1e-6), name
    assert gradients[True]["router.weight"].abs().sum() > 0


TINY_MOE = {
    "model": {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
              "seq_length": 16, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32,
                                        "capacity_factor": 1.0, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}},
    "data": {"vocab_size": 400, "num_sentinels": 4},
    "train": {"seed": 7},
}


def _moe_model_forward_backward(rank: int, world_size: int, tensor_parallel_size: int) -> dict:
    config = config_from_dict({**TINY_MOE, "parallel": {"tensor": tensor_parallel_size}})
    validate(config)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    model = build_model(config).train()
    tokens = torch.randint(0, config.data.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, torch.roll(tokens, -1, dims=1))
    loss.backward()
    statistics = [layer.mlp.statistics.take(torch.device("cpu")) for layer in model.blocks]
    model.eval()
    return {"logits": gather_vocab_shards(model(tokens)).detach(), "loss": loss.detach(),
            "weights": gather_full_parameters(model), "grads": gather_full_parameters(model, lambda p: p.grad),
            "statistics": statistics}


def test_tensor_parallel_moe_model_matches_single_rank():
    """Experts split like dense MLPs, the router replicated: TP2 computes TP1's logits, loss (capacity
    drops included) and gradients, the auxiliary losses' among them."""
    reference = run_on_ranks(_moe_model_forward_backward, 1, 1)[0]
    sharded = run_on_ranks(_moe_model_forward_backward, 2, 2)[0]
    assert (sharded["logits"] - reference["logits"]).abs().max() <= 1e-5
    assert abs(sharded["loss"].item() - reference["loss"].item()) <= 1e-5
    for name, weight in reference["weights"].items():
        assert torch.equal(sharded["weights"][name], weight), name
    for name, grad in reference["grads"].items():
        assert (sharded["grads"][name] - grad).abs().max().item() <= 1e-5, name
    for ours, theirs in zip(sharded["statistics"], reference["statistics"], strict=True):
        assert torch.allclose(ours, theirs, atol=1e-6)
    assert reference["grads"]["blocks.0.mlp.router.weight"].abs().sum() > 0
    dropped = sum(float(row[-2]) for row in reference["statistics"])
    assert dropped > 0  # capacity factor 1.0 on a random router drops some assignments


def _expert_parallel_forward_backward(rank: int, world_size: int) -> dict:
    """Two halves of a batch through a dropless MoE model: one rank takes both, one after the other;
    under expert parallelism each of two ranks takes one half and holds half of the experts."""
    moe = {**TINY_MOE["model"]["moe"], "capacity_factor": None}
    config = config_from_dict({**TINY_MOE, "model": {**TINY_MOE["model"], "moe": moe},
                               "parallel": {"expert": world_size}})
    validate(config)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    model = build_model(config).train()
    tokens = torch.randint(0, config.data.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    halves = [tokens[:2], tokens[2:]] if world_size == 1 else [tokens[2 * rank:2 * rank + 2]]
    losses = []
    for half in halves:
        loss = model(half, torch.roll(half, -1, dims=1))
        loss.backward()
        losses.append(loss.detach())
    model.eval()
    return {"losses": losses, "logits": [model(half).detach() for half in halves],
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def test_expert_parallel_moe_model_matches_single_rank():
    """Experts split over two ranks exchanging tokens by all-to-all: each half's loss and logits are
    the single rank's, each expert's gradient sums both ranks' tokens, the dense ones each rank's own."""
    reference = run_on_ranks(_expert_parallel_forward_backward, 1)[0]
    ranks = run_on_ranks(_expert_parallel_forward_backward, 2)
    held = [{name for name in rank["grads"] if ".experts." in name} for rank in ranks]
    assert not held[0] & held[1] and held[0] | held[1] == {n for n in reference["grads"] if ".experts." in n}
    assert all(".experts.0." in name or ".experts.1." in name for name in held[0])  # rank 0: experts 0, 1
    for rank, ours in enumerate(ranks):
        assert abs(ours["losses"][0].item() - reference["losses"][rank].item()) <= 1e-5
        assert (ours["logits"][0] - reference["logits"][rank]).abs().max().item() <= 1e-5
        for name in held[rank]:
            assert (ours["grads"][name] - reference["grads"][name]).abs().max().item() <= 1e-5, name
    for name, grad in reference["grads"].items():
        if ".experts." not in name:
            assert (ranks[0]["grads"][name] + ranks[1]["grads"][name] - grad).abs().max().item() <= 1e-5, name


def test_routing_metrics_are_shares_and_means_over_forwards():
    statistics = RoutingStatistics(num_experts=2)
    routing = route(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), top_k=1, capacity=1)
    statistics.add(routing, torch.tensor(1.2), torch.tensor(0.4))
    statistics.add(routing, torch.tensor(0.8), torch.tensor(0.2))  # e.g. the step's second micro-batch
    sums = torch.stack([statistics.take(torch.device("cpu"))])
    metrics = routing_metrics(sums, [3])
    assert metrics["moe/blocks.3/load_0"] == pytest.approx(2 / 3)
    assert metrics["moe/blocks.3/load_1"] == pytest.approx(1 / 3)
    assert metrics["moe/blocks.3/dropped_fraction"] == pytest.approx(1 / 3)  # expert 0 takes 1 of 2
    assert metrics["moe/blocks.3/aux_loss"] == pytest.approx(1.0)
    assert metrics["moe/z_loss"] == pytest.approx(0.3)
    assert statistics.take(torch.device("cpu")).sum() == 0  # taken: the next step starts from nothing


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"num_experts": 4, "top_k": 5}, "model.moe.top_k=5 must be between 1 and model.moe.num_experts=4"),
    ({"num_experts": 4, "every": 0}, "model.moe.every=0"),
    ({"num_experts": 4, "capacity_factor": 0.0}, "model.moe.capacity_factor=0.0 must be > 0"),
    ({"num_experts": -1}, "model.moe.num_experts=-1"),
])
def test_bad_moe_settings_are_refused_naming_the_key(overrides: dict, fragment: str):
    from scaletrain.config import ConfigError

    config = config_from_dict({**TINY_MOE, "model": {**TINY_MOE["model"], "moe": overrides}})
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        validate(config)


def test_sequence_parallelism_with_experts_is_refused_with_the_fix():
    from scaletrain.config import ConfigError

    config = config_from_dict({**TINY_MOE, "parallel": {"tensor": 2, "sequence_parallel": True}})
    with pytest.raises(ConfigError, match="set parallel.sequence_parallel=false"):
        validate(config)


@pytest.mark.parametrize(("model", "parallel", "fragment"), [
    ({"moe": {"num_experts": 0}}, {"expert": 2}, "the model has no experts; set model.moe.num_experts"),
    ({}, {"expert": 3}, "parallel.expert=3 must divide model.moe.num_experts=4"),
    ({}, {"expert": 2, "zero_stage": 3}, "use parallel.zero_stage=1 or 2"),
    ({}, {"expert": 4, "data": 2}, "parallel.expert=4 must divide parallel.data=2"),
])
def test_bad_expert_parallel_layouts_are_refused_naming_the_key(model: dict, parallel: dict, fragment: str):
    from scaletrain.config import ConfigError

    config = config_from_dict({**TINY_MOE, "model": {**TINY_MOE["model"], **model}, "parallel": parallel})
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        validate(config)


def test_expert_parallel_size_must_divide_the_launched_data_parallel_ranks():
    from scaletrain.config import ConfigError
    from scaletrain.parallel.layout import resolve_for_world

    config = config_from_dict({**TINY_MOE, "parallel": {"expert": 4, "tensor": 2}})
    with pytest.raises(ConfigError, match=r"parallel\.expert=4 must divide the data-parallel size 2 \(world size 4"):
        resolve_for_world(config, 4)
    assert resolve_for_world(config, 8).parallel.data == 4
