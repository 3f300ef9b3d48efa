"""Document masking and sliding windows: the masks are Hugging Face's, a packed document computes what it
computes alone (GPT and Llama, positions restarted or not, behind a window, and under a prefix LM), a window hides
exactly the keys it should, and FlexAttention's block mask states the same limits as the boolean mask."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from torch.nn.attention.flex_attention import create_mask
from transformers.masking_utils import causal_mask_function, packed_sequence_mask_function, sliding_window_overlay

from scaletrain.config import ConfigError
from scaletrain.config_loader import config_from_dict, validate
from scaletrain.data.objectives import document_ids
from scaletrain.data.tokenizer import SPECIAL_IDS
from scaletrain.families import build_model
from scaletrain.model import attention_masks
from scaletrain.model.attention_masks import (
    causal_mask,
    decoder_attention_mask,
    decoder_block_mask,
    positions_in_document,
    visible_keys,
    visible_keys_mask_mod,
)
from scaletrain.model.decoder import attention_backend
from scaletrain.model.layers import KVCache
from tests.distributed.harness import run_on_ranks

EOS = SPECIAL_IDS["eos"]
VOCAB = 400
SEQ = 32
SHAPES = {
    "gpt": {"family": "gpt"},
    "llama": {"family": "llama", "num_kv_heads": 2, "ffn_hidden_size": 96},
}


def tiny_config(family: str, **model):
    config = config_from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_length": SEQ, "init_std": 0.2,
                  **SHAPES[family], **model},
        "data": {"vocab_size": VOCAB, "num_sentinels": 4},
        "train": {"seed": 3},
    })
    validate(config)
    return config


def packed_tokens() -> torch.Tensor:
    """Two sequences of SEQ tokens: the tail of a cut document, then documents opened by an eos each."""
    tokens = torch.randint(7, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[0, [5, 17, 18]] = EOS  # a one-token document (an eos followed by an eos) at 17
    tokens[1, [0, 20]] = EOS  # the sequence starts with a document
    return tokens


def documents(tokens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(sequence, start, end) of every packed document."""
    ids = document_ids(tokens, EOS)
    spans = []
    for row in range(tokens.shape[0]):
        for document in ids[row].unique().tolist():
            where = (ids[row] == document).nonzero().flatten()
            spans.append((row, int(where[0]), int(where[-1]) + 1))
    return spans


# ---------------------------------------------------------------------------------------------
# The masks


def test_masks_follow_hugging_faces_conventions():
    """Our sliding window is transformers' `kv_idx > q_idx - sliding_window` on top of causal (so a
    MistralForCausalLM export attends as we do), and our document mask is its packed-sequence mask."""
    queries, keys = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    for window in (1, 3, 8):
        theirs = causal_mask_function(0, 0, queries, keys) & sliding_window_overlay(window)(0, 0, queries, keys)
        assert torch.equal(causal_mask(SEQ, SEQ, torch.device("cpu"), window), theirs)
        assert causal_mask(SEQ, SEQ, torch.device("cpu"), window).sum(1).max() == window
    tokens = packed_tokens()
    ids = document_ids(tokens, EOS)
    ours = decoder_attention_mask(SEQ, tokens.device, document_ids=ids)
    for row in range(2):
        packed = packed_sequence_mask_function(ids)(row, 0, queries, keys)
        assert torch.equal(ours[row, 0], packed & causal_mask_function(0, 0, queries, keys))


def test_decoding_masks_are_bottom_right_aligned():
    """Behind a cache the new queries are the last positions: 2 queries over 6 keys with a window of 3."""
    assert causal_mask(2, 6, torch.device("cpu"), 3).tolist() == [
        [False, False, True, True, True, False],
        [False, False, False, True, True, True],
    ]


def test_document_ids_and_positions():
    """The eos opens the next document (its label is that document's first token); positions restart there."""
    tokens = torch.tensor([[9, 9, EOS, 9, 9, 9, EOS, EOS, 9]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 3, 3]]
    assert positions_in_document(ids).tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1]]


# ---------------------------------------------------------------------------------------------
# A packed document computes what it computes alone


# A packed document alone: at position 0, or at its packed positions (run on); within a sliding window too.
VARIANTS = {
    "positions_restart": {"document_positions": True},
    "positions_run_on": {"document_positions": False},
    "window": {"document_positions": True, "sliding_window": 5},
}


def _packed_and_alone(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    tokens = packed_tokens()
    ids = document_ids(tokens, EOS)
    labels = torch.roll(tokens, -1, dims=1)
    results = {}
    for family in SHAPES:
        for variant, options in VARIANTS.items():
            restart = options["document_positions"]
            model = build_model(tiny_config(family, document_masking=True, **options)).eval()
            with torch.no_grad():
                packed = model(tokens, document_ids=ids)
                loss = model(tokens, labels, document_ids=ids)
                alone = {}
                for row, start, end in documents(tokens):
                    # alone at position 0, or at its packed positions (a cache that starts at `start`)
                    cache = None if restart else KVCache({}, {}, length=start)
                    alone[row, start] = model(tokens[row:row + 1, start:end], cache=cache)[0]
                    losses = torch.nn.functional.cross_entropy(alone[row, start], labels[row, start:end],
                                                               reduction="none")
                    alone[row, start, "losses"] = losses
                plain = model(tokens)
            results[family, variant] = {"packed": packed, "loss": loss, "alone": alone, "plain": plain}
    return results


@pytest.fixture(scope="module")
def packed_and_alone() -> dict:
    return run_on_ranks(_packed_and_alone, 1)[0]


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_packed_document_computes_what_it_computes_alone(packed_and_alone: dict, family: str, variant: str):
    result = packed_and_alone[family, variant]
    spans = documents(packed_tokens())
    assert len(spans) == 6
    for row, start, end in spans:
        torch.testing.assert_close(result["packed"][row, start:end], result["alone"][row, start], rtol=1e-5,
                                   atol=1e-5, msg=f"{family} document at {row}:{start}-{end}")
    # the packed loss is the mean over all tokens of the documents' own losses
    losses = torch.cat([result["alone"][row, start, "losses"] for row, start, _ in spans])
    torch.testing.assert_close(result["loss"], losses.mean(), rtol=1e-5, atol=1e-6)
    # and attending across documents would have changed them
    assert (result["plain"] - result["packed"]).abs().max() > 1e-2


def _restarted_positions(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    tokens = packed_tokens()[:1]
    ids = document_ids(tokens, EOS)
    results = {}
    for family in SHAPES:
        model = build_model(tiny_config(family, document_positions=True)).eval()
        with torch.no_grad():
            results[family] = (model(tokens, document_ids=ids)[0], model(tokens)[0])
    return results


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_positions_restart_at_the_first_document_start(family: str):
    """document_positions alone (attention still crosses documents): the tokens before the first eos keep
    positions 0..4, every later one gets new ones. (With document_masking as well, Llama's rotary attention
    depends only on distances within a document, so restarting its positions changes nothing there.)"""
    restarted, plain = run_on_ranks(_restarted_positions, 1)[0][family]
    assert torch.equal(restarted[:5], plain[:5])
    assert (restarted[5:] - plain[5:]).abs().amax(dim=-1).min() > 1e-4


def _prefix_lm_with_documents(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    tokens = packed_tokens()[:1]
    ids = document_ids(tokens, EOS)
    prefix = torch.tensor([12])  # inside the second document, [5, 17)
    model = build_model(tiny_config("llama", document_masking=True, document_positions=True)).eval()
    with torch.no_grad():
        return {
            "packed": model(tokens, prefix_lengths=prefix, document_ids=ids)[0],
            "first": model(tokens[:, :5], prefix_lengths=torch.tensor([5]))[0],  # wholly inside the prefix
            "second": model(tokens[:, 5:17], prefix_lengths=prefix - 5)[0],  # its prefix part bidirectional
            "third": model(tokens[:, 17:18])[0],
            "rest": model(tokens[:, 18:])[0],
        }


def test_a_prefix_lm_with_document_masking_keeps_the_prefix_inside_its_document():
    """The prefix is bidirectional within each document it covers; the documents after it are causal LMs."""
    result = run_on_ranks(_prefix_lm_with_documents, 1)[0]
    pieces = torch.cat([result[name] for name in ("first", "second", "third", "rest")])
    torch.testing.assert_close(result["packed"], pieces, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Sliding window


def _window_reach(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    results = {}
    for family in SHAPES:
        model = build_model(tiny_config(family, sliding_window=4)).eval()
        tokens = packed_tokens()[:1]
        with torch.no_grad():
            base = model(tokens)
            changed = {}
            for position in (19, 20):
                other = tokens.clone()
                other[0, position] = (tokens[0, position] + 1) % VOCAB
                changed[position] = model(other)
        results[family] = (base, changed)
    return results


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_a_window_of_four_sees_three_tokens_back_per_layer(family: str):
    """Two layers of a window of 4: position 26 reaches back 2 x 3 = 6 tokens, to 20 but not to 19."""
    base, changed = run_on_ranks(_window_reach, 1)[0][family]
    assert torch.equal(changed[19][0, 26:], base[0, 26:])
    assert (changed[19][0, 25] - base[0, 25]).abs().max() > 1e-4
    assert (changed[20][0, 26] - base[0, 26]).abs().max() > 1e-4


@pytest.mark.parametrize("overrides, fragment", [
    ({"sliding_window": 0}, "model.sliding_window=0 must be >= 1"),
    ({"sliding_window": 8, "objective": "prefix_lm"}, "objective.kind=causal_lm"),
])
def test_invalid_windows_are_refused(overrides: dict, fragment: str):
    objective = overrides.pop("objective", "auto")
    config = config_from_dict({"model": {"family": "llama", **overrides}, "objective": {"kind": objective}})
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        validate(config)


def test_a_family_without_the_keys_names_those_that_have_them():
    with pytest.raises(ConfigError, match="model.family=gpt or llama has it"):
        config_from_dict({"model": {"family": "bert", "document_masking": True}})


# ---------------------------------------------------------------------------------------------
# FlexAttention: the block mask is the boolean mask


def random_documents(seed: int, batch: int, seq: int) -> torch.Tensor:
    """Document ids of `batch` random packs: eos at random places, runs of eos (one-token documents) too."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(7, VOCAB, (batch, seq), generator=generator)
    tokens[torch.rand(batch, seq, generator=generator) < 0.12] = EOS
    tokens[0, 3:5] = EOS
    return document_ids(tokens, EOS)


FLEX_LIMITS = {  # (documents, window, prefix)
    "documents": (True, None, False),
    "window": (False, 7, False),
    "documents_and_window": (True, 5, False),
    "prefix_lm": (False, None, True),
    "prefix_lm_and_documents": (True, None, True),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("limits", sorted(FLEX_LIMITS))
def test_the_mask_mod_is_visible_keys_exactly(limits: str, seed: int):
    """The mask_mod's dense mask equals visible_keys' boolean mask, and the block mask computes exactly the
    128 x 128 tiles in which some query sees some key (the others it skips)."""
    with_documents, window, with_prefix = FLEX_LIMITS[limits]
    batch, seq = 3, 300
    ids = random_documents(seed, batch, seq) if with_documents else None
    prefix = torch.randint(1, seq, (batch,), generator=torch.Generator().manual_seed(seed)) if with_prefix else None
    positions = torch.arange(seq)
    boolean = visible_keys(positions, positions, prefix, ids, window).expand(batch, 1, seq, seq)
    flex = create_mask(visible_keys_mask_mod(prefix, ids, window), batch, 1, seq, seq, device="cpu")
    assert torch.equal(flex, boolean)
    block_mask = decoder_block_mask(seq, torch.device("cpu"), prefix, ids, window)
    padded = torch.nn.functional.pad(boolean, (0, 84, 0, 84))  # 384 = 3 tiles of 128
    tiles = padded.reshape(batch, 1, 3, 128, 3, 128).any(dim=5).any(dim=3)
    assert torch.equal(block_mask.to_dense().expand_as(tiles).bool(), tiles)


def test_only_causal_attention_needs_no_block_mask():
    """Plain causal attention, or a window no query reaches past, keeps SDPA's is_causal."""
    assert decoder_block_mask(64, torch.device("cpu")) is None
    assert decoder_block_mask(64, torch.device("cpu"), window=64) is None
    assert decoder_block_mask(64, torch.device("cpu"), window=63) is not None


# The flex backend's logits against SDPA's, same weights: GPT packing documents (positions restarted), also as a
# prefix LM; Llama (grouped-query, 4 heads on 2) with documents behind a window. CPU runs FlexAttention's forward only.
FLEX_CASES = {  # name: (family, model options, prefix lengths)
    "gpt_documents": ("gpt", {"document_masking": True, "document_positions": True}, None),
    "gpt_prefix_lm_documents": ("gpt", {"document_masking": True}, [12, 3]),
    "llama_window_documents": ("llama", {"document_masking": True, "sliding_window": 5}, None),
}


def _flex_and_sdpa(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel()
    tokens = packed_tokens()
    ids = document_ids(tokens, EOS)
    builds = []
    build_block_mask = attention_masks.decoder_block_mask

    def counted(*args, **kwargs):
        builds.append(args[0])
        return build_block_mask(*args, **kwargs)

    attention_masks.decoder_block_mask = counted  # counts the builds of the real thing
    results = {}
    for name, (family, options, prefix) in FLEX_CASES.items():
        prefix_lengths = None if prefix is None else torch.tensor(prefix)
        results[name] = []
        for backend in ("sdpa", "flex"):
            model = build_model(tiny_config(family, attention_backend=backend, **options)).eval()
            with torch.no_grad():
                results[name].append(model(tokens, prefix_lengths=prefix_lengths, document_ids=ids))
    results["builds"] = len(builds)
    model = build_model(tiny_config("gpt", attention_backend="flex", document_masking=True)).train()
    try:
        model(tokens, document_ids=ids)
    except ConfigError as error:
        results["cpu_training"] = str(error)
    return results


@pytest.fixture(scope="module")
def flex_and_sdpa() -> dict:
    return run_on_ranks(_flex_and_sdpa, 1)[0]


@pytest.mark.parametrize("name", sorted(FLEX_CASES))
def test_flex_attention_computes_what_sdpa_computes(flex_and_sdpa: dict, name: str):
    sdpa, flex = flex_and_sdpa[name]
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_the_block_mask_is_built_once_per_forward(flex_and_sdpa: dict):
    """Three flex forwards of two layers each: one block mask per forward, not one per layer."""
    assert flex_and_sdpa["builds"] == 3


def test_flex_refuses_to_train_on_cpu(flex_and_sdpa: dict):
    assert "model.attention_backend=flex cannot train on CPU" in flex_and_sdpa["cpu_training"]


@pytest.mark.parametrize("overrides, fragment", [
    ({"model": {"attention_backend": "flash"}}, "model.attention_backend='flash'; use sdpa, flex or auto"),
    ({"model": {"attention_backend": "flex", "dropout": 0.1}}, "FlexAttention has no attention dropout"),
    ({"model": {"attention_backend": "flex"}, "parallel": {"context": 2}}, "runs its own ring attention"),
])
def test_flex_is_refused_where_it_cannot_run(overrides: dict, fragment: str):
    config = config_from_dict({**overrides, "model": {"family": "llama", **overrides["model"]}})
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        validate(config)


@pytest.mark.parametrize("overrides, backend", [
    ({"model": {"attention_backend": "flex"}}, "flex"),
    ({"model": {"attention_backend": "sdpa"}}, "sdpa"),
    ({"model": {"dropout": 0.1}}, "sdpa"),
    ({"parallel": {"context": 2}}, "sdpa"),
])
def test_auto_picks_flex_only_where_it_runs(overrides: dict, backend: str):
    config = config_from_dict({**overrides, "model": {"family": "gpt", **overrides.get("model", {})}})
    assert attention_backend(config) == backend
    plain = config_from_dict({"model": {"family": "gpt"}})
    assert attention_backend(plain) == ("flex" if torch.cuda.is_available() else "sdpa")
