"""BERT weights to and from Hugging Face `BertForMaskedLM`, or `BertForPreTraining` when the model has
the sentence-order head (HF's pooler + `cls.seq_relationship`).

HF's BERT is post-LN, so a pre-LN BERT has no equivalent and is refused. HF splits our fused
[Q; K; V] in three; the decoder is tied to the word embedding as in our BERT. The HF vocabulary is
our padded one (conversion.py explains why).

HF has no span boundary head (SpanBERT's SBO, `span_boundary_head.*`): it is training-only, and the
export drops it with a line on stderr. SpanBERT's released models do the same: its README says they
"have the same format as the HuggingFace BERT models" (facebookresearch/SpanBERT), no SBO head.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scaletrain.checkpoint.hf.conversion import (
    StateDict,
    check_all_taken,
    check_vocabulary_rows,
    fp32,
    hf_model,
    take,
    weights_only,
)
from scaletrain.checkpoint.hf.reading import load_checked, read_hf_config
from scaletrain.config import Config, ModelConfig
from scaletrain.data.tokenizer import SPECIAL_IDS
from scaletrain.model.family import HFAdapter

if TYPE_CHECKING:  # transformers is imported by the functions that convert (1.6 s)
    from transformers import BertForMaskedLM, BertForPreTraining

FAMILY = "bert"
SPAN_BOUNDARY_PREFIX = "span_boundary_head."  # training-only: not exported


def export_hf(state: StateDict, config: ModelConfig, vocab_size: int, out_dir: str | Path) -> Path:
    """Write `out_dir` (config.json + model.safetensors) loadable with `from_pretrained(out_dir)`.
    vocab_size is the padded vocabulary the model was built with (`Config.padded_vocab_size`).
    The span boundary head, which HF's BERT lacks, is left out (training-only, like SpanBERT's releases)."""
    weights = weights_only(state)
    if any(name.startswith(SPAN_BOUNDARY_PREFIX) for name in weights):
        print("not exported: the span boundary head (objective.span_boundary, span_boundary_head.*), which is "
              "training-only; the BERT encoder and its masked-LM head are", file=sys.stderr, flush=True)
        weights = {name: tensor for name, tensor in weights.items() if not name.startswith(SPAN_BOUNDARY_PREFIX)}
    check_vocabulary_rows(weights, "embedding.word.weight", vocab_size)
    to_hf(weights, config, vocab_size).save_pretrained(out_dir)
    return Path(out_dir)


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict from a `BertForMaskedLM` or `BertForPreTraining` directory."""
    from transformers import BertForMaskedLM, BertForPreTraining

    architectures = read_hf_config(Path(hf_dir)).get("architectures") or []
    if not {"BertForMaskedLM", "BertForPreTraining"} & set(architectures):
        raise ValueError(
            f"{hf_dir} holds {architectures or 'an unnamed architecture'}, without BERT's masked-LM head; "
            "import a BertForMaskedLM or BertForPreTraining checkpoint"
        )
    with_sentence_order = "BertForPreTraining" in architectures
    model = load_checked(BertForPreTraining if with_sentence_order else BertForMaskedLM, hf_dir)
    hf_state = model.state_dict()
    num_layers = model.config.num_hidden_layers
    weights = {ours: fp32(hf_state[hf_name]) for ours, hf_name in _bert_names(num_layers, with_sentence_order)}
    for layer in range(num_layers):
        prefix = f"bert.encoder.layer.{layer}.attention.self"
        for kind in ("weight", "bias"):
            parts = [hf_state[f"{prefix}.{projection}.{kind}"] for projection in ("query", "key", "value")]
            weights[f"blocks.{layer}.attention.qkv.{kind}"] = fp32(torch.cat(parts, dim=0))
    return weights


def to_hf(weights: StateDict, config: ModelConfig, vocab_size: int) -> BertForMaskedLM | BertForPreTraining:
    """The HF BERT holding `weights`, every one of which must have its place in it."""
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

    weights = dict(weights)
    if "final_norm.weight" in weights:
        raise ValueError("this BERT is pre-LN (it has final_norm); HF's BertModel is post-LN, so it cannot be exported")
    with_sentence_order = "sentence_order_head.pooler.weight" in weights
    type_vocab_size = take(weights, "embedding.token_type.weight", FAMILY, keep=True).shape[0]
    hf_config = BertConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.ffn_size,
        hidden_act="gelu",  # exact erf GELU, as our BERT blocks and head
        hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout,
        max_position_embeddings=config.seq_length, type_vocab_size=type_vocab_size,
        initializer_range=config.init_std, layer_norm_eps=config.layernorm_eps, pad_token_id=SPECIAL_IDS["pad"],
    )
    names = _bert_names(config.num_layers, with_sentence_order)
    hf_state = {hf_name: take(weights, ours, FAMILY) for ours, hf_name in names}
    for layer in range(config.num_layers):
        for kind in ("weight", "bias"):
            query, key, value = take(weights, f"blocks.{layer}.attention.qkv.{kind}", FAMILY).chunk(3, dim=0)
            prefix = f"bert.encoder.layer.{layer}.attention.self"
            hf_state |= {f"{prefix}.query.{kind}": query, f"{prefix}.key.{kind}": key, f"{prefix}.value.{kind}": value}
    # Tied, as in our BERT: the decoder is the word embedding and its bias is cls.predictions.bias.
    hf_state["cls.predictions.decoder.weight"] = hf_state["bert.embeddings.word_embeddings.weight"]
    hf_state["cls.predictions.decoder.bias"] = hf_state["cls.predictions.bias"]
    check_all_taken(weights, FAMILY)
    model_class = BertForPreTraining if with_sentence_order else BertForMaskedLM
    return hf_model(model_class, hf_config, hf_state)


def _bert_names(num_layers: int, with_sentence_order: bool) -> list[tuple[str, str]]:
    """(our name, HF's name) for every weight but the fused QKV, which HF splits in three."""
    names = [
        ("embedding.word.weight", "bert.embeddings.word_embeddings.weight"),
        ("embedding.position.weight", "bert.embeddings.position_embeddings.weight"),
        ("embedding.token_type.weight", "bert.embeddings.token_type_embeddings.weight"),
        ("lm_head.bias", "cls.predictions.bias"),
    ]
    modules = [  # linear and LayerNorm modules: a weight and a bias each
        ("embedding.norm", "bert.embeddings.LayerNorm"),
        ("lm_head.dense", "cls.predictions.transform.dense"),
        ("lm_head.norm", "cls.predictions.transform.LayerNorm"),
    ]
    if with_sentence_order:
        modules += [
            ("sentence_order_head.pooler", "bert.pooler.dense"),
            ("sentence_order_head.classifier", "cls.seq_relationship"),
        ]
    block = (
        ("attention.output", "attention.output.dense"), ("attention_norm", "attention.output.LayerNorm"),
        ("mlp.fc", "intermediate.dense"), ("mlp.proj", "output.dense"), ("mlp_norm", "output.LayerNorm"),
    )
    for layer in range(num_layers):
        modules += [(f"blocks.{layer}.{ours}", f"bert.encoder.layer.{layer}.{hf_name}") for ours, hf_name in block]
    return names + [(f"{ours}.{kind}", f"{hf_name}.{kind}") for ours, hf_name in modules for kind in ("weight", "bias")]


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, config.model, config.padded_vocab_size, out_dir)


ADAPTER = HFAdapter(
    model_class="BertForMaskedLM",
    export=_export,
    import_=import_hf,
    # data/masking.py and data/sentence_pairs.py: [CLS] A [SEP], the second segment of type 1.
    text_framing=("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    token_types=True,
)
