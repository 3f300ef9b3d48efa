"""Exact counts: parameters equal the real models' tensors, FLOPs equal torch's FlopCounterMode.

Every variant is built with `build_model` and runs one forward + backward on the first batch of
its own objective's loader over the small Shakespeare dataset (tests/conftest.py), so BERT's
labelled positions and T5's decoder length are the collators' own.

FlopCounterMode has formulas for matmuls (mm, addmm, bmm, baddbmm) and for the CUDA attention
kernels (flash, memory-efficient, cuDNN), but not for `_scaled_dot_product_flash_attention_for_cpu`,
the fused kernel SDPA picks on CPU (torch 2.13): attention would count 0. The FLOPs check therefore
runs SDPA's math backend, which decomposes attention into counted bmm's;
test_fused_cpu_attention_is_invisible_to_the_counter shows the gap is exactly the attention term.
Neither side counts elementwise work (biases, norms, activations, softmax, residual adds, the
cross-entropy): that is the model-FLOPs convention, so the two agree exactly, not approximately.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from megatron.core import parallel_state
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.batch import IGNORE_INDEX
from scaletrain.config import Config
from scaletrain.config_loader import load_config
from scaletrain.families import build_model, model_counts
from scaletrain.families.bert import model as bert
from scaletrain.families.gpt.model import model_flops_per_token
from scaletrain.families.t5 import model as t5
from scaletrain.model.encoder import labelled_positions
from scaletrain.train.objective import build_objective
from scaletrain.train.step import model_inputs
from tests.distributed.harness import run_on_ranks
from tests.train.runs import REPO

BATCH = 3
EMBEDDING_TABLES = ("embedding.word.weight", "embedding.position.weight", "embedding.token_type.weight",
                    "embedding.weight", "relative_position_bias.weight")
# vocab_divisible_by=96 pads the dataset's 1024 pieces to 1056 rows: the logits cover the padding too.
SHAPES = {
    "small": ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=24"],
    "wide": ["model.num_layers=3", "model.hidden_size=48", "model.num_heads=6", "model.seq_length=40",
             "model.ffn_hidden_size=80"],
}
FAMILIES = {
    "gpt": ["model.family=gpt"],
    "gpt_prefix_lm": ["model.family=gpt", "objective.kind=prefix_lm"],
    "bert_post": ["model.family=bert"],
    "bert_pre_sop": ["model.family=bert", "model.layernorm_position=pre", "objective.sentence_pairs=sop"],
    "bert_nsp_whole_words": ["model.family=bert", "objective.sentence_pairs=nsp", "objective.whole_word_masking=true"],
    "bert_span_boundary": ["model.family=bert", "objective.span_masking=true", "objective.span_boundary=true"],
    "bert_sop_span_boundary_whole_words": ["model.family=bert", "objective.sentence_pairs=sop",
                                           "objective.whole_word_masking=true", "objective.span_masking=true",
                                           "objective.span_boundary=true"],
    "t5_relu_tied": ["model.family=t5", "model.ffn_activation=relu"],
    "t5_gated_untied": ["model.family=t5", "model.tie_embeddings=false", "model.head_dim=12",
                        "model.num_decoder_layers=1"],
    "t5_prefix_lm": ["model.family=t5", "objective.kind=prefix_lm"],
    "llama_gqa": ["model.family=llama", "model.num_kv_heads=2", "model.ffn_hidden_size=56"],
    "llama_mqa_head_dim": ["model.family=llama", "model.num_kv_heads=1", "model.head_dim=6"],
    # mixture of experts, dropless (the counts are the dropless work): every other block, or all of them
    "gpt_moe_switch": ["model.family=gpt", "model.moe.num_experts=4", "model.moe.top_k=1", "model.moe.every=2",
                       "model.moe.ffn_hidden_size=40"],
    "llama_moe_top2": ["model.family=llama", "model.num_kv_heads=2", "model.moe.num_experts=4", "model.moe.top_k=2"],
}
VARIANTS = {
    f"{family}/{shape}": [*SHAPES[shape], *overrides] for family, overrides in FAMILIES.items() for shape in SHAPES
}


def tiny_config(name: str, data_dir: Path) -> Config:
    return load_config(REPO / "configs" / "gpt_tiny.yaml", [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=0",
        "model.vocab_divisible_by=96", f"train.micro_batch_size={BATCH}", *VARIANTS[name],
    ])


def measure_models(rank: int, world_size: int, data_dir: Path) -> dict[str, dict]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return {name: measure_model(tiny_config(name, data_dir)) for name in VARIANTS}


def measure_model(config: Config) -> dict:
    """Unique parameters, embedding tables by name, and the counted FLOPs of one training step."""
    model = build_model(config)
    parameters = dict(model.named_parameters())  # unique tensors: a tied weight appears once
    batch = next(iter(build_objective(config).train_loader(0, 1, 0)))
    flops = {}
    for kernel, context in (("math", sdpa_kernel(SDPBackend.MATH)), ("fused", contextlib.nullcontext())):
        with context, FlopCounterMode(display=False) as counter:
            model(**model_inputs(batch)).backward()
        flops[kernel] = counter.get_total_flops()
    return {
        "total": sum(p.numel() for p in parameters.values()),
        "embedding": sum(p.numel() for n, p in parameters.items() if n.endswith(EMBEDDING_TABLES)),
        "flops": flops["math"], "flops_with_fused_attention": flops["fused"],
        "labelled_per_sample": (batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist(),
        "shapes": {key: tuple(value.shape) for key, value in batch.items()},
    }


@pytest.fixture(scope="module")
def measured(small_dataset: Path) -> dict[str, dict]:
    return run_on_ranks(measure_models, 1, small_dataset)[0]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_counts_match_the_model(measured: dict, small_dataset: Path, name: str) -> None:
    counts = model_counts(tiny_config(name, small_dataset))
    assert counts.total_params == measured[name]["total"]
    assert counts.embedding_params == measured[name]["embedding"]
    assert counts.non_embedding_params == counts.total_params - counts.embedding_params > 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_flops_match_the_flop_counter(measured: dict, small_dataset: Path, name: str) -> None:
    config = tiny_config(name, small_dataset)
    counts = model_counts(config)
    if config.model.family == "bert":  # the head runs on this batch's labelled positions only
        labelled = measured[name]["labelled_per_sample"]
        counts = bert.counts(config, labelled=sum(labelled) / len(labelled))
    expected = counts.flops_per_token * BATCH * config.model.seq_length
    assert expected == pytest.approx(measured[name]["flops"], rel=1e-12)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_cpu_attention_is_invisible_to_the_counter(measured: dict, small_dataset: Path, shape: str) -> None:
    """With SDPA's own choice on CPU the counter misses exactly GPT's attention term, 3 · l · 4h·s per
    token (or nothing, should torch register a formula for the CPU kernel)."""
    model = tiny_config(f"gpt/{shape}", small_dataset).model
    attention = 3 * model.num_layers * 4 * model.hidden_size * model.seq_length * model.seq_length * BATCH
    unseen = measured[f"gpt/{shape}"]["flops"] - measured[f"gpt/{shape}"]["flops_with_fused_attention"]
    assert unseen in (0, attention)


@pytest.mark.parametrize("name", [name for name in VARIANTS if name.startswith("bert")])
def test_bert_head_positions_are_the_collators_budget(measured: dict, small_dataset: Path, name: str) -> None:
    """The planning count, round(mask_prob · n) per sample, is what a sample without a document
    boundary or padding gets; those (or a whole word over the budget) can only lower it."""
    labelled = measured[name]["labelled_per_sample"]
    budget = labelled_positions(tiny_config(name, small_dataset))
    assert max(labelled) == budget


@pytest.mark.parametrize("name", [name for name in VARIANTS if name.startswith("t5")])
def test_t5_lengths_are_the_collators(measured: dict, small_dataset: Path, name: str) -> None:
    config = tiny_config(name, small_dataset)
    shapes = measured[name]["shapes"]
    assert shapes["encoder_tokens"] == (BATCH, config.model.seq_length)
    assert shapes["decoder_tokens"] == (BATCH, t5.target_length(config))


@pytest.mark.parametrize("name", [name for name in VARIANTS if name.startswith("gpt")])
def test_gpt_flops_are_the_mfu_formula(small_dataset: Path, name: str) -> None:
    config = tiny_config(name, small_dataset)
    assert model_counts(config).flops_per_token == model_flops_per_token(config.model, config.padded_vocab_size)


@pytest.mark.parametrize(("config_name", "overrides", "params"), [
    # Hugging Face's parameter counts of the released models (unique tensors, a tied head once).
    ("gpt3_125m", ["data.vocab_size=50257", "model.vocab_divisible_by=1", "model.seq_length=1024"],
     124_439_808),  # gpt2 (GPT2LMHeadModel)
    ("bert_base", ["data.vocab_size=30522", "model.vocab_divisible_by=1", "objective.sentence_pairs=nsp"],
     110_106_428),  # bert-base-uncased (BertForPreTraining: MLM and NSP heads)
    ("t5_small", [], 60_506_624),  # t5-small
    ("t5_base", [], 222_903_552),  # t5-base
    ("t5_large", [], 737_668_096),  # t5-large
    ("t5_small", ["model.num_layers=8", "model.num_decoder_layers=8", "model.num_heads=6", "model.ffn_hidden_size=1024",
                  "model.ffn_activation=gated-gelu", "model.tie_embeddings=false"], 76_961_152),  # google/t5-v1_1-small
    ("t5_base", ["model.ffn_hidden_size=2048", "model.ffn_activation=gated-gelu", "model.tie_embeddings=false"],
     247_577_856),  # google/t5-v1_1-base
])
def test_counts_of_published_models(config_name: str, overrides: list[str], params: int) -> None:
    assert model_counts(load_config(REPO / "configs" / f"{config_name}.yaml", overrides)).total_params == params


def test_gpt3_125m_non_embedding_params() -> None:
    """GPT-3 Small (Brown et al. 2020, table 2.1): 125M parameters, 85M of them in the blocks."""
    counts = model_counts(load_config(REPO / "configs" / "gpt3_125m.yaml"))
    assert 120e6 < counts.total_params < 130e6
    assert 84e6 < counts.non_embedding_params < 86e6


@pytest.mark.parametrize("name", [name for name in VARIANTS if "_moe_" in name])
def test_active_params_are_the_total_less_the_experts_a_token_skips(measured: dict, small_dataset: Path,
                                                                     name: str) -> None:
    """Active = every parameter less, in each MoE layer, the E - k experts a token does not run."""
    config = tiny_config(name, small_dataset)
    counts, moe = model_counts(config), config.model.moe
    expert = build_model(config).blocks[0].mlp.experts["0"]  # block 0 is a MoE layer at any `every`
    skipped = (moe.num_experts - moe.top_k) * sum(p.numel() for p in expert.parameters())
    moe_layers = len(moe.moe_layers(config.model.num_layers))
    assert counts.active_params == measured[name]["total"] - moe_layers * skipped < counts.total_params
