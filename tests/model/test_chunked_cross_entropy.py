"""train.loss_chunk_size: the output layer and vocab-parallel cross-entropy a chunk of tokens at a time give
the loss and gradients of the whole logits (gpt and llama; TP=1 and 2, sequence parallel, pipeline stages,
ZeRO-3; fp32, and bf16 logits with an fp32 loss), and keep less for backward than the [tokens, vocab] fp32
softmax the plain loss keeps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model
from scaletrain.model.chunked_cross_entropy import DeferredLogits
from scaletrain.model.layers import masked_vocab_parallel_loss_sum
from scaletrain.parallel.layout import resolve_for_world
from scaletrain.parallel.sequence_parallel import enable_cpu_sequence_parallel, register_sequence_parallel_grad_hooks
from tests.distributed.harness import gather_full_parameters, run_on_ranks

SEQ, BATCH = 16, 3  # 48 positions: chunks of 7 and 20 leave a short last chunk, 16 divides them, 64 is one chunk
CHUNK_SIZES = (7, 16, 20, 64)
FAMILIES = {
    "gpt": {"model": {"family": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": SEQ}},
    "llama": {"model": {"family": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
                        "ffn_hidden_size": 48, "seq_length": SEQ}},
}
DATA = {"vocab_size": 400, "num_sentinels": 4}


def _config(family: str, loss_chunk_size: int, parallel: dict | None = None, train: dict | None = None,
            data: dict = DATA):
    config = config_from_dict({**FAMILIES[family], "data": data, "parallel": parallel or {},
                               "train": {"seed": 5, "loss_chunk_size": loss_chunk_size, **(train or {})}})
    validate(config)
    return config


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels [batch, seq], some masked: a prefix LM's prefix and a padded tail."""
    tokens = torch.randint(0, DATA["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(tokens, -1, dims=1)
    labels[0, :5] = -100
    labels[2, 11:] = -100
    return tokens, labels


def _loss_and_gradients(model: torch.nn.Module) -> dict[str, Any]:
    """Loss, full parameter gradients and the gradient of the final norm's output (the output layer's input)."""
    final_hidden = {}

    def keep_gradient(_module, _inputs, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: final_hidden.setdefault("grad", grad.detach().clone()))

    handle = model.final_norm.register_forward_hook(keep_gradient)
    loss = model(*_batch())
    loss.backward()
    handle.remove()
    return {"loss": loss.detach(), "grads": gather_full_parameters(model, lambda param: param.grad),
            "hidden_grad": final_hidden["grad"]}


def _single_rank(rank: int, world_size: int, family: str) -> dict[int, dict[str, Any]]:
    parallel_state.initialize_model_parallel()
    results = {}
    for chunk in (0, *CHUNK_SIZES):
        model = build_model(_config(family, chunk))
        results[chunk] = {**_loss_and_gradients(model), "logits": model(_batch()[0]).detach()}
    return results


def _assert_same(result: dict[str, Any], reference: dict[str, Any], loss_tolerance: float = 1e-6) -> None:
    assert abs(result["loss"].item() - reference["loss"].item()) <= loss_tolerance
    assert result["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        difference = (result["grads"][name] - grad).abs().max().item()
        assert difference <= 1e-5, f"gradient of {name} differs by {difference}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_loss_and_gradients_match_the_whole_logits(family: str) -> None:
    """GPT's output layer is the tied word embedding (its gradient sums the embedding's and the logits'),
    llama's an untied ColumnParallelLinear; chunks that do and do not divide the 48 positions."""
    results = run_on_ranks(_single_rank, 1, family)[0]
    reference = results[0]
    tied = "embedding.word.weight" if family == "gpt" else "output.weight"
    assert tied in reference["grads"]
    for chunk in CHUNK_SIZES:
        _assert_same(results[chunk], reference)
        assert torch.equal(results[chunk]["logits"], reference["logits"])  # without labels: the logits themselves
        difference = (results[chunk]["hidden_grad"] - reference["hidden_grad"]).abs().max().item()
        assert difference <= 1e-5, f"chunk {chunk}: the final hidden state's gradient differs by {difference}"


def _tensor_parallel(rank: int, world_size: int, family: str) -> dict[str, dict[str, Any]]:
    """TP=2 with chunks of 7, without and with sequence parallelism."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    enable_cpu_sequence_parallel()
    results = {}
    for sequence_parallel in (False, True):
        model = build_model(_config(family, 7, {"tensor": 2, "sequence_parallel": sequence_parallel}))
        register_sequence_parallel_grad_hooks(model)  # norms see a sequence slice: sum their gradients over TP
        results[f"sp={sequence_parallel}"] = _loss_and_gradients(model)
    return results


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_loss_under_tensor_parallelism_matches_the_single_rank_loss(family: str) -> None:
    """Each TP rank scores its vocabulary shard per chunk, max and sums all-reduced over the TP group."""
    reference = run_on_ranks(_single_rank, 1, family)[0][0]
    ranks = run_on_ranks(_tensor_parallel, 2, family)
    for layout, result in ranks[0].items():
        assert torch.equal(result["loss"], ranks[1][layout]["loss"]), layout
        _assert_same(result, reference, loss_tolerance=1e-5)


def _engine_losses(rank: int, world_size: int, family: str, parallel: dict, data: dict) -> dict[int, list[float]]:
    """Two optimizer steps of DeepSpeed's engine (grad_accum 2), then an evaluation pass: the losses."""
    from scaletrain.parallel.groups import init_distributed
    from scaletrain.train.engine import build_engine
    from scaletrain.train.parallelize import build_training_model
    from scaletrain.train.step import pipeline_inputs

    tokens, labels = _batch()
    batches = [{"tokens": tokens, "labels": labels}] * 2
    results = {}
    for chunk in (0, 7):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        config = resolve_for_world(_config(family, chunk, parallel, {
            "micro_batch_size": BATCH, "grad_accum": 2, "precision": "fp32"}, data), world_size)
        topology = init_distributed(config)
        engine = build_engine(build_training_model(config, topology), config, topology)
        for group in engine.optimizer.param_groups:
            group["lr"] = 1e-2
        if topology.pipeline_parallel_size > 1:
            losses = [float(engine.train_batch(data_iter=pipeline_inputs(engine, iter(batches)))) for _ in range(2)]
            losses.append(float(engine.eval_batch(pipeline_inputs(engine, iter(batches)), num_micro_batches=2)))
        else:
            losses = []
            for _ in range(2):
                for batch in batches:
                    loss = engine(**batch)
                    engine.backward(loss)
                    engine.step()
                losses.append(loss.item())
            with torch.no_grad():
                losses.append(engine(**batches[0]).item())
        results[chunk] = losses
    return results


# ZeRO-3 partitions only parameters of over 1e5 elements (DeepSpeed's stage3_param_persistence_threshold):
# a 4096-row vocabulary puts the output weight among them
ZERO3_DATA = {"vocab_size": 4000, "num_sentinels": 4}


@pytest.mark.parametrize(("family", "layout"), [("gpt", "pp2"), ("gpt", "dp2_zero3"), ("llama", "dp2_zero3")])
def test_chunked_loss_trains_as_the_whole_logits_in_deepspeed_engines(family: str, layout: str) -> None:
    """Two pipeline stages: the output layer on the last stage hands DeferredLogits to DeepSpeed's loss_fn.
    ZeRO-3: the loss reads the partitioned output weight inside the engine's forward, gathered there (gpt's
    tied embedding as the model's registered borrowed weight, llama's found by DeepSpeed). The second
    step's loss follows from the first step's gradients, the output weight's included."""
    parallel, data = {"pp2": ({"pipeline": 2}, DATA), "dp2_zero3": ({"zero_stage": 3}, ZERO3_DATA)}[layout]
    ranks = run_on_ranks(_engine_losses, 2, family, parallel, data)
    whole, chunked = ranks[-1][0], ranks[-1][7]
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert whole[1] < whole[0]


def _output_layer_inputs(dtype: torch.dtype, vocab: int = 1000, hidden_size: int = 16):
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(SEQ, BATCH * 2, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(vocab, hidden_size, generator=generator) * 0.3).to(dtype))
    labels = torch.randint(0, vocab, (BATCH * 2, SEQ), generator=generator)
    labels[1, :4] = -100
    return hidden, weight, labels


def _saved_bytes_and_gradients(chunk_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """Bytes autograd keeps for backward while the loss is taken (distinct storages, the weight included),
    the mean loss, and the gradients of the output layer's input and weight."""
    hidden, weight, labels = _output_layer_inputs(dtype)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = DeferredLogits(hidden, weight, chunk_size) if chunk_size else F.linear(hidden, weight)
        loss_sum, count = masked_vocab_parallel_loss_sum(logits, labels)
        loss = loss_sum / count
    loss.backward()
    return {"saved": sum(storages.values()), "loss": loss.detach(), "hidden_grad": hidden.grad,
            "weight_grad": weight.grad}


def _saved_bytes(rank: int, world_size: int) -> dict[str, dict[int, dict[str, Any]]]:
    parallel_state.initialize_model_parallel()
    return {str(dtype): {chunk: _saved_bytes_and_gradients(chunk, dtype) for chunk in (0, 24)}
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def saved_bytes() -> dict[str, dict[int, dict[str, Any]]]:
    return run_on_ranks(_saved_bytes, 1)[0]


def test_the_chunked_loss_keeps_less_than_the_fp32_logits_for_backward(saved_bytes) -> None:
    tokens, vocab = SEQ * BATCH * 2, 1000
    fp32_logits = tokens * vocab * 4
    whole, chunked = saved_bytes["torch.float32"][0], saved_bytes["torch.float32"][24]
    assert whole["saved"] >= fp32_logits  # the plain loss keeps its fp32 softmax
    assert chunked["saved"] < fp32_logits / 4  # the input, the weight, targets and a log-normalizer per token


def test_bf16_logits_with_an_fp32_loss_agree_chunked_and_whole(saved_bytes) -> None:
    """bf16 weights and hidden state, as DeepSpeed's bf16 trains them: logits in bf16, the loss in fp32 (the
    plain loss casts them with .float(), the chunked one a chunk at a time); gradients come back in bf16.
    The chunks' GEMMs may round differently from the whole one, so they agree to bf16's precision, and
    both to the fp32 loss of the same bf16-rounded weights."""
    whole, chunked = saved_bytes["torch.bfloat16"][0], saved_bytes["torch.bfloat16"][24]
    assert chunked["loss"].dtype == torch.float32
    assert chunked["loss"].item() == pytest.approx(whole["loss"].item(), rel=1e-3)
    assert chunked["loss"].item() == pytest.approx(saved_bytes["torch.float32"][0]["loss"].item(), rel=1e-2)
    for name in ("hidden_grad", "weight_grad"):
        assert chunked[name].dtype == torch.bfloat16
        scale = whole[name].float().abs().max().item()
        assert (chunked[name].float() - whole[name].float()).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.parametrize("family", ["bert", "albert", "electra", "t5", "bart"])
def test_families_without_the_chunked_loss_refuse_it(family: str) -> None:
    config = config_from_dict({"model": {"family": family}, "data": DATA, "train": {"loss_chunk_size": 1024}})
    with pytest.raises(ConfigError, match=f"train.loss_chunk_size=1024 is not available for {family}.*=0"):
        validate(config)


def test_loss_chunk_size_is_checked() -> None:
    with pytest.raises(ConfigError, match="train.loss_chunk_size=-1 must be >= 0"):
        validate(config_from_dict({"data": DATA, "train": {"loss_chunk_size": -1}}))
