"""Llama: TP=2 computes the TP=1 model (grouped-query, multi-query with replicated key/values, and
multi-head attention), `transformers`' LlamaForCausalLM computes our logits from exported weights
(TP=1 and TP=2), import inverts export, and incremental decoding with the KV cache matches full
recomputation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from transformers import LlamaForCausalLM

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import build_model
from scaletrain.families.llama.hf import ADAPTER as LLAMA_ADAPTER
from scaletrain.model.layers import KVCache
from scaletrain.parallel.sharding import is_tensor_parallel, split_for_rank
from tests.distributed.harness import gather_full_parameters, gather_vocab_shards, run_on_ranks

VARIANTS = {
    "gqa": {"num_kv_heads": 2},  # 2 key/value heads over TP=2: one per rank
    "mqa": {"num_kv_heads": 1, "head_dim": 12},  # 1 key/value head, replicated on both ranks
    "mha": {"num_kv_heads": 4, "rope_theta": 500000.0},
}
SEQ = 12


def llama_config(variant: str, tensor_parallel_size: int):
    config = config_from_dict({
        "model": {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 96,
                  "seq_length": 16, **VARIANTS[variant]},
        "data": {"vocab_size": 400, "num_sentinels": 4},
        "parallel": {"tensor": tensor_parallel_size},
        "train": {"seed": 5},
    })
    validate(config)
    return config


def _tokens() -> torch.Tensor:
    return torch.randint(7, 400, (3, SEQ), generator=torch.Generator().manual_seed(0))


def _load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = full[name]
            if is_tensor_parallel(param):
                tensor = split_for_rank(tensor, param.partition_dim, param.partition_stride, rank, world)
            param.copy_(tensor)


def _both_layouts(rank: int, world_size: int, out_dir: Path) -> dict:
    results = {}
    for tensor_parallel_size in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        for variant in VARIANTS:
            config = llama_config(variant, tensor_parallel_size)
            model = build_model(config)
            tokens = _tokens()
            logits = gather_vocab_shards(model(tokens))
            loss = model(tokens, labels=torch.roll(tokens, -1, dims=1))
            loss.backward()
            record = {
                "weights": gather_full_parameters(model), "logits": logits, "loss": loss.detach(),
                "grads": gather_full_parameters(model, lambda p: p.grad),
            }
            if tensor_parallel_size == 2:
                # perturb (so norms are not all ones), export from the TP=2 shards, import back
                full = {name: t + 0.02 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
                        for i, (name, t) in enumerate(sorted(gather_full_parameters(model).items()))}
                _load_full(model, full)
                record["perturbed_logits"] = gather_vocab_shards(model(tokens).detach())
                export_dir = out_dir / variant
                if rank == 0:
                    LLAMA_ADAPTER.export(full, config, export_dir)
                torch.distributed.barrier()
                imported = LLAMA_ADAPTER.import_(export_dir)
                record["import_exact"] = all(torch.equal(imported[name], full[name]) for name in full)
                record["import_names"] = set(imported) == set(full)
            results[(tensor_parallel_size, variant)] = record
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out_dir = tmp_path_factory.mktemp("llama_export")
    return {"ranks": run_on_ranks(_both_layouts, 2, out_dir), "out_dir": out_dir}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_matches_single_rank(layouts: dict, variant: str) -> None:
    single, split = layouts["ranks"][0][(1, variant)], layouts["ranks"][0][(2, variant)]
    for name, weight in single["weights"].items():
        assert torch.equal(weight, split["weights"][name]), name
    torch.testing.assert_close(split["logits"], single["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split["loss"], single["loss"], rtol=1e-6, atol=0)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_computes_our_logits_from_a_tp2_export(layouts: dict, variant: str) -> None:
    ours = layouts["ranks"][0][(2, variant)]
    hf = LlamaForCausalLM.from_pretrained(layouts["out_dir"] / variant).eval()
    with torch.no_grad():
        theirs = hf(_tokens()).logits
    assert (theirs - ours["perturbed_logits"]).abs().max() < 1e-4
    assert ours["import_names"] and ours["import_exact"]


def _decode(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {}
    for variant in VARIANTS:
        model = build_model(llama_config(variant, world_size)).eval()
        tokens = _tokens()
        with torch.no_grad():
            full = gather_vocab_shards(model(tokens))
            cache = KVCache.empty()
            steps = [gather_vocab_shards(model(tokens[:, :5], cache=cache))]
            for position in range(5, SEQ):
                steps.append(gather_vocab_shards(model(tokens[:, position:position + 1], cache=cache)))
        results[variant] = (full, torch.cat(steps, dim=1), cache.length)
    return results


def test_kv_cache_decoding_matches_full_recomputation() -> None:
    """A 5-token prefill then one token at a time gives the logits of one full forward (TP=2)."""
    for full, incremental, length in run_on_ranks(_decode, 2)[0].values():
        assert length == SEQ
        torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)
