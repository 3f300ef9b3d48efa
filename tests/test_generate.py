"""Generation: greedy decoding with the KV cache picks the tokens full recomputation picks (GPT past
its learned positions, Llama at TP=1 and TP=2, T5's decoder, GPT and Llama behind a sliding window whose
cache holds only the window), and a family that cannot generate says so."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state

from scaletrain.config_loader import config_from_dict, validate
from scaletrain.families import FAMILIES, build_model, get_family
from scaletrain.generate import GENERATIONS, NotGeneratingError, generation_of
from scaletrain.model.layers import KVCache
from scaletrain.model.sampling import sample_seq2seq, sample_tokens
from scaletrain.parallel.sharding import gather_last_dim
from tests.distributed.harness import run_on_ranks
from tests.train.runs import REPO, launcher, run_scaletrain, scaletrain_environment, tiny_overrides

VOCAB = 400
CONTEXT = 16
SHAPES = {
    "gpt": {"num_layers": 2, "hidden_size": 64, "num_heads": 4},
    "llama": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 96},
    "t5": {"num_layers": 2, "num_decoder_layers": 2, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 96},
}


def tiny_config(family: str, tensor_parallel_size: int = 1):
    config = config_from_dict({
        "model": {"family": family, "seq_length": CONTEXT, "init_std": 0.2, **SHAPES[family]},
        "data": {"vocab_size": VOCAB, "num_sentinels": 4},
        "parallel": {"tensor": tensor_parallel_size},
        "train": {"seed": 3},
    })
    validate(config)
    return config


def _greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int, use_cache: bool) -> list[int]:
    return sample_tokens(model, prompt, new_tokens, CONTEXT, VOCAB, 0.0, None, torch.Generator(),
                         use_cache=use_cache)


def _greedy_seq2seq_by_recomputation(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """The reference: decode the whole prefix again for every token, no cache."""
    with torch.no_grad():
        encoder_output = model.encode(torch.tensor([prompt]))
        tokens = [0]
        for _ in range(new_tokens):
            decoded = model.decode(torch.tensor([tokens]), encoder_output)
            tokens.append(int(gather_last_dim(model.output_logits(decoded)[-1, 0])[:VOCAB].argmax()))
    return tokens[1:]


def _decode_all(rank: int, world_size: int) -> dict:
    """Greedy tokens (cached, recomputed) by (family, TP size), and seeded samples of GPT both ways."""
    prompt = torch.randint(7, VOCAB, (5,), generator=torch.Generator().manual_seed(1)).tolist()
    results = {}
    for tensor_parallel_size, families in ((2, ("llama",)), (1, ("gpt", "llama"))):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        for family in families:
            model = build_model(tiny_config(family, tensor_parallel_size))
            # 2 * CONTEXT new tokens: GPT's learned positions end at CONTEXT, so the window slides.
            results[family, tensor_parallel_size] = tuple(
                _greedy(model, prompt, 2 * CONTEXT, use_cache) for use_cache in (True, False)
            )
        if tensor_parallel_size == 1:
            results["sampled"] = tuple(
                sample_tokens(model, prompt, 2 * CONTEXT, CONTEXT, VOCAB, 0.8, 20, torch.Generator().manual_seed(7),
                              use_cache=use_cache) for use_cache in (True, False)
            )
            model = _perturbed(build_model(tiny_config("t5")))
            cached = sample_seq2seq(model, prompt, 12, VOCAB, 0.0, None, torch.Generator())
            results["t5", 1] = (cached, _greedy_seq2seq_by_recomputation(model, prompt, 12))
        parallel_state.destroy_model_parallel()
    return results


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Large random weights, so a tiny T5 does not greedily repeat one token from the start."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def decoded() -> dict:
    return run_on_ranks(_decode_all, 2)[0]


@pytest.mark.parametrize("family, tensor_parallel_size", [("gpt", 1), ("llama", 1), ("llama", 2), ("t5", 1)])
def test_greedy_tokens_with_the_cache_match_recomputation(decoded: dict, family: str, tensor_parallel_size: int):
    cached, recomputed = decoded[family, tensor_parallel_size]
    assert len(cached) == (12 if family == "t5" else 2 * CONTEXT)
    assert cached == recomputed
    assert len(set(cached)) > 1, "a constant sequence would not tell the two paths apart"


def test_sampling_with_the_cache_draws_what_recomputation_draws(decoded: dict) -> None:
    """Temperature and top-k with one seed: the same tokens either way, sliding included."""
    cached, recomputed = decoded["sampled"]
    assert cached == recomputed


WINDOW = 5


class UnboundedCache(KVCache):
    """The reference for a windowed model's cache: it keeps every key, and the window mask alone limits them."""

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor, keep: int | None = None):
        return super().extend(layer, key, value)


def _decode_windowed(rank: int, world_size: int) -> dict:
    """Per family with model.sliding_window=WINDOW: logits of a prefill and then one token at a time behind
    the bounded and an unbounded cache, against one full forward; greedy tokens with the cache and by
    recomputation; the keys each layer holds."""
    parallel_state.initialize_model_parallel()
    tokens = torch.randint(7, VOCAB, (1, CONTEXT), generator=torch.Generator().manual_seed(4))
    prompt = tokens[0, :5].tolist()
    results = {}
    for family in ("gpt", "llama"):
        config = tiny_config(family)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, sliding_window=WINDOW))
        model = build_model(config).eval()
        with torch.no_grad():
            full = model(tokens)
            steps = {}
            for cache in (KVCache.empty(), UnboundedCache.empty()):
                logits = [model(tokens[:, :7], cache=cache)]
                logits += [model(tokens[:, position:position + 1], cache=cache) for position in range(7, CONTEXT)]
                held = [keys.shape[2] for keys in cache.keys.values()]
                steps[type(cache).__name__] = (torch.cat(logits, dim=1), held)
        results[family] = {
            "full": full, "steps": steps,
            "greedy": tuple(_greedy(model, prompt, 2 * CONTEXT, use_cache) for use_cache in (True, False)),
        }
    return results


@pytest.fixture(scope="module")
def decoded_windowed() -> dict:
    return run_on_ranks(_decode_windowed, 1)[0]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_sliding_window_bounds_the_cache_and_decodes_what_the_full_forward_computes(
    decoded_windowed: dict, family: str
):
    """Mistral's rolling cache (Jiang et al. 2023, sec. 2): each layer keeps the last WINDOW - 1 keys, and
    decoding behind it computes the logits of the full windowed forward and of a cache that keeps all."""
    result = decoded_windowed[family]
    bounded, held = result["steps"]["KVCache"]
    unbounded, held_unbounded = result["steps"]["UnboundedCache"]
    assert held == [WINDOW - 1, WINDOW - 1] and held_unbounded == [CONTEXT, CONTEXT]
    torch.testing.assert_close(bounded, result["full"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unbounded, result["full"], rtol=1e-5, atol=1e-5)
    cached, recomputed = result["greedy"]
    assert cached == recomputed and len(set(cached)) > 1


@pytest.mark.slow  # trains a one-step BERT run (~2 min on 2 cores)
def test_generate_on_a_bert_run_says_it_cannot(small_dataset: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(small_dataset, run_dir), "train.steps=1", "train.eval_every=1",
                 "train.warmup_steps=0", "checkpoint.every=1", "tracking.wandb=disabled"]
    run_scaletrain("train", [str(REPO / "configs" / "bert_tiny.yaml"), *overrides])
    result = subprocess.run([*launcher(1), "generate", str(run_dir)], cwd=REPO, env=scaletrain_environment(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "trained a bert model, which cannot generate: BERT is a masked LM" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_family_generates_through_a_registered_generation(tmp_path: Path):
    """ModelFamily.generation names an entry of GENERATIONS; a name nobody registered is one error
    listing the known ones, and a family without generation says why it cannot."""
    for name in FAMILIES:
        family = get_family(name)
        if family.generation is None:
            with pytest.raises(NotGeneratingError, match="cannot generate"):
                generation_of(family, tmp_path)
        else:
            assert generation_of(family, tmp_path) is GENERATIONS[family.generation]
    unknown = dataclasses.replace(get_family("gpt"), generation="beam")
    with pytest.raises(ValueError, match="'beam', which is not registered; the known ones are causal, seq2seq"):
        generation_of(unknown, tmp_path)
