"""ALBERT weights to and from Hugging Face `AlbertForMaskedLM`, or `AlbertForPreTraining` when the
model has the sentence-order head (HF's pooler + `sop_classifier`).

HF's AlbertModel shares whole layers in groups (`num_hidden_groups`, one layer per group here):
one group is our model.sharing=all (`shared_block`), one group per layer is sharing=none
(`blocks.i`). Sharing only the attention or the feed-forward sublayer has no HF equivalent and is
refused. HF splits our fused [Q; K; V] in three; the decoder is tied to the E-wide word embedding
as in our ALBERT. The HF vocabulary is our padded one (conversion.py explains why).
"""

from __future__ import annotations

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
from scaletrain.families.albert.model import SHARED
from scaletrain.model.family import HFAdapter

if TYPE_CHECKING:  # transformers is imported by the functions that convert (1.6 s)
    from transformers import AlbertConfig, AlbertForMaskedLM, AlbertForPreTraining

FAMILY = "albert"
EXPORTED_SHARING = ("all", "none")
HF_LAYERS = "albert.encoder.albert_layer_groups"


def export_hf(state: StateDict, config: ModelConfig, vocab_size: int, out_dir: str | Path) -> Path:
    """Write `out_dir` (config.json + model.safetensors) loadable with `from_pretrained(out_dir)`.
    vocab_size is the padded vocabulary the model was built with (`Config.padded_vocab_size`)."""
    check_exportable(config)
    weights = weights_only(state)
    check_vocabulary_rows(weights, "embedding.word.weight", vocab_size)
    to_hf(weights, config, vocab_size).save_pretrained(out_dir)
    return Path(out_dir)


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict from an `AlbertForMaskedLM` or `AlbertForPreTraining` directory whose
    layers are shared all in one group (model.sharing=all) or not at all (sharing=none)."""
    from transformers import AlbertForMaskedLM, AlbertForPreTraining

    architectures = read_hf_config(Path(hf_dir)).get("architectures") or []
    if not {"AlbertForMaskedLM", "AlbertForPreTraining"} & set(architectures):
        raise ValueError(
            f"{hf_dir} holds {architectures or 'an unnamed architecture'}, without ALBERT's masked-LM head; "
            "import an AlbertForMaskedLM or AlbertForPreTraining checkpoint"
        )
    with_sentence_order = "AlbertForPreTraining" in architectures
    model = load_checked(AlbertForPreTraining if with_sentence_order else AlbertForMaskedLM, hf_dir)
    hf_config = model.config
    sharing = _sharing_of(hf_config)
    hf_state = model.state_dict()
    blocks = _block_prefixes(sharing, hf_config.num_hidden_layers)
    weights = {ours: fp32(hf_state[hf_name]) for ours, hf_name in _albert_names(blocks, with_sentence_order)}
    for ours, hf_prefix in blocks:
        for kind in ("weight", "bias"):
            parts = [hf_state[f"{hf_prefix}.attention.{projection}.{kind}"] for projection in ("query", "key", "value")]
            weights[f"{ours}.attention.qkv.{kind}"] = fp32(torch.cat(parts, dim=0))
    return weights


def check_exportable(config: ModelConfig) -> None:
    if config.sharing not in EXPORTED_SHARING:
        raise ValueError(
            f"model.sharing={config.sharing}: HF's AlbertModel shares whole layers only, so a model sharing just "
            "its attention or feed-forward sublayers cannot be exported; export runs trained with model.sharing=all "
            "or none"
        )


def _sharing_of(hf_config: AlbertConfig) -> str:
    groups, layers = hf_config.num_hidden_groups, hf_config.num_hidden_layers
    if hf_config.inner_group_num == 1 and groups == 1:
        return "all"
    if hf_config.inner_group_num == 1 and groups == layers:
        return "none"
    raise ValueError(
        f"this ALBERT has {groups} layer groups of {hf_config.inner_group_num} layers for {layers} layers; "
        "scaletrain imports one group of one layer (model.sharing=all) or one group per layer (sharing=none)"
    )


def to_hf(weights: StateDict, config: ModelConfig, vocab_size: int) -> AlbertForMaskedLM | AlbertForPreTraining:
    """The HF ALBERT holding `weights`, every one of which must have its place in it."""
    from transformers import AlbertConfig, AlbertForMaskedLM, AlbertForPreTraining

    check_exportable(config)
    weights = dict(weights)
    with_sentence_order = "sentence_order_head.pooler.weight" in weights
    type_vocab_size = take(weights, "embedding.token_type.weight", FAMILY, keep=True).shape[0]
    hf_config = AlbertConfig(
        vocab_size=vocab_size, embedding_size=config.embedding_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_hidden_groups=1 if config.sharing == "all" else config.num_layers,
        inner_group_num=1, num_attention_heads=config.num_heads, intermediate_size=config.ffn_size,
        hidden_act="gelu_new",  # tanh GELU, as our ALBERT blocks and head
        hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout, classifier_dropout_prob=0.0,
        max_position_embeddings=config.seq_length, type_vocab_size=type_vocab_size,
        initializer_range=config.init_std, layer_norm_eps=config.layernorm_eps,
        pad_token_id=SPECIAL_IDS["pad"], bos_token_id=SPECIAL_IDS["cls"], eos_token_id=SPECIAL_IDS["sep"],
    )
    blocks = _block_prefixes(config.sharing, config.num_layers)
    hf_state = {hf_name: take(weights, ours, FAMILY) for ours, hf_name in _albert_names(blocks, with_sentence_order)}
    for ours, hf_prefix in blocks:
        for kind in ("weight", "bias"):
            query, key, value = take(weights, f"{ours}.attention.qkv.{kind}", FAMILY).chunk(3, dim=0)
            hf_state |= {f"{hf_prefix}.attention.query.{kind}": query, f"{hf_prefix}.attention.key.{kind}": key,
                         f"{hf_prefix}.attention.value.{kind}": value}
    # Tied, as in our ALBERT: the decoder is the word embedding and its bias is predictions.bias.
    hf_state["predictions.decoder.weight"] = hf_state["albert.embeddings.word_embeddings.weight"]
    hf_state["predictions.decoder.bias"] = hf_state["predictions.bias"]
    check_all_taken(weights, FAMILY)
    model_class = AlbertForPreTraining if with_sentence_order else AlbertForMaskedLM
    return hf_model(model_class, hf_config, hf_state)


def _block_prefixes(sharing: str, num_layers: int) -> list[tuple[str, str]]:
    """(our block, HF's layer) prefixes: the shared block is group 0's layer, or block i group i's."""
    if sharing == "all":
        return [(SHARED, f"{HF_LAYERS}.0.albert_layers.0")]
    return [(f"blocks.{layer}", f"{HF_LAYERS}.{layer}.albert_layers.0") for layer in range(num_layers)]


def _albert_names(blocks: list[tuple[str, str]], with_sentence_order: bool) -> list[tuple[str, str]]:
    """(our name, HF's name) for every weight but the fused QKV, which HF splits in three."""
    names = [
        ("embedding.word.weight", "albert.embeddings.word_embeddings.weight"),
        ("embedding.position.weight", "albert.embeddings.position_embeddings.weight"),
        ("embedding.token_type.weight", "albert.embeddings.token_type_embeddings.weight"),
        ("lm_head.bias", "predictions.bias"),
    ]
    modules = [  # linear and LayerNorm modules: a weight and a bias each
        ("embedding.norm", "albert.embeddings.LayerNorm"),
        ("projection", "albert.encoder.embedding_hidden_mapping_in"),
        ("lm_head.dense", "predictions.dense"),
        ("lm_head.norm", "predictions.LayerNorm"),
    ]
    if with_sentence_order:
        modules += [
            ("sentence_order_head.pooler", "albert.pooler"),
            ("sentence_order_head.classifier", "sop_classifier.classifier"),
        ]
    block = (
        ("attention.output", "attention.dense"), ("attention_norm", "attention.LayerNorm"),
        ("mlp.fc", "ffn"), ("mlp.proj", "ffn_output"), ("mlp_norm", "full_layer_layer_norm"),
    )
    for ours_prefix, hf_prefix in blocks:
        modules += [(f"{ours_prefix}.{ours}", f"{hf_prefix}.{hf_name}") for ours, hf_name in block]
    return names + [(f"{ours}.{kind}", f"{hf_name}.{kind}") for ours, hf_name in modules for kind in ("weight", "bias")]


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, config.model, config.padded_vocab_size, out_dir)


ADAPTER = HFAdapter(
    model_class="AlbertForMaskedLM",
    export=_export,
    import_=import_hf,
    # data/masking.py and data/sentence_pairs.py: [CLS] A [SEP], the second segment of type 1.
    text_framing=("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    token_types=True,
)
