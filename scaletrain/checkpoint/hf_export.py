"""Hugging Face `transformers` export and import of full (TP=1) state dicts, one converter pair per family.

Input and output are state dicts in scaletrain's parameter names at TP=1: `consolidated_state_dict`
of a training checkpoint, or live shards joined with `merge_shards`; `split_for_rank` shards an
imported one again. The HF model keeps our *padded* vocabulary (config.vocab_size = padded size):
the padding rows take part in our softmax, so keeping them makes HF's probabilities ours exactly;
the tokenizer never emits their ids. Weights are fp32, as our master weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
)

from scaletrain.config import Config, ModelConfig
from scaletrain.data.tokenizer import SPECIAL_IDS
from scaletrain.model.family import HFAdapter

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class HFConversion:
    """One family's pair: write(weights, model_config, vocab_size, out_dir) writes the HF checkpoint
    directory; read(hf_dir) returns its weights in our names. word_embedding names the weight whose
    rows are the vocabulary, which export checks against vocab_size."""

    write: Callable[[StateDict, ModelConfig, int, Path], None]
    read: Callable[[Path], StateDict]
    word_embedding: str = "embedding.word.weight"


def export_hf(
    state_dict: StateDict, family: str, model_config: ModelConfig, vocab_size: int, out_dir: str | Path
) -> Path:
    """Write `out_dir` (config.json + model.safetensors) loadable with `from_pretrained(out_dir)`.
    vocab_size is the padded vocabulary the model was built with (`Config.padded_vocab_size`)."""
    conversion = _conversion(family)
    weights = {name: tensor for name, tensor in state_dict.items() if not name.endswith("_extra_state")}
    rows = weights[conversion.word_embedding].shape[0] if conversion.word_embedding in weights else 0
    if rows != vocab_size:
        raise ValueError(
            f"the state dict's {conversion.word_embedding} has {rows} rows but vocab_size={vocab_size}; pass the "
            "padded vocabulary size and a full TP=1 state dict (merge shards with consolidated_state_dict)"
        )
    conversion.write(weights, model_config, vocab_size, Path(out_dir))
    return Path(out_dir)


def import_hf(hf_dir: str | Path, family: str) -> StateDict:
    """A TP=1 state dict in scaletrain's names from an HF checkpoint directory of `family`."""
    return _conversion(family).read(Path(hf_dir))


# ---------------------------------------------------------------------------------------------
# GPT <-> GPT2LMHeadModel (Radford et al. 2019). GPT-2's Conv1D stores weights as [in, out],
# the transpose of our linear layers; its c_attn is our fused [Q; K; V] as is.


def gpt_to_hf(weights: StateDict, config: ModelConfig, vocab_size: int) -> GPT2LMHeadModel:
    weights = dict(weights)
    hf_config = GPT2Config(
        vocab_size=vocab_size, n_positions=config.seq_length, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_size,
        activation_function="gelu_new",  # tanh GELU, as our GPT blocks
        layer_norm_epsilon=config.layernorm_eps, initializer_range=config.init_std,
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        bos_token_id=SPECIAL_IDS["bos"], eos_token_id=SPECIAL_IDS["eos"], tie_word_embeddings=True,
    )
    hf_state = {}
    for ours, hf_name, transposed in _gpt2_names(config.num_layers):
        tensor = _take(weights, ours, "gpt")
        hf_state[hf_name] = tensor.t() if transposed else tensor
    hf_state["lm_head.weight"] = hf_state["transformer.wte.weight"]  # tied, as in our GPT
    _check_all_taken(weights, "gpt")
    return _hf_model(GPT2LMHeadModel, hf_config, hf_state)


def gpt_from_hf(hf_dir: Path) -> StateDict:
    hf_model = GPT2LMHeadModel.from_pretrained(hf_dir)
    hf_state = hf_model.state_dict()
    return {
        ours: _fp32(hf_state[hf_name].t() if transposed else hf_state[hf_name])
        for ours, hf_name, transposed in _gpt2_names(hf_model.config.n_layer)
    }


def _gpt2_names(num_layers: int) -> list[tuple[str, str, bool]]:
    """(our name, GPT-2's name, stored transposed) for every weight."""
    names = [
        ("embedding.word.weight", "transformer.wte.weight", False),
        ("embedding.position.weight", "transformer.wpe.weight", False),
        ("final_norm.weight", "transformer.ln_f.weight", False),
        ("final_norm.bias", "transformer.ln_f.bias", False),
    ]
    block = (
        ("attention_norm", "ln_1", False), ("attention.qkv", "attn.c_attn", True),
        ("attention.output", "attn.c_proj", True), ("mlp_norm", "ln_2", False),
        ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True),
    )
    for layer in range(num_layers):
        for ours, hf_name, conv1d in block:
            names.append((f"blocks.{layer}.{ours}.weight", f"transformer.h.{layer}.{hf_name}.weight", conv1d))
            names.append((f"blocks.{layer}.{ours}.bias", f"transformer.h.{layer}.{hf_name}.bias", False))
    return names


# ---------------------------------------------------------------------------------------------
# BERT <-> BertForMaskedLM, or BertForPreTraining when the model has the sentence-order head
# (HF's pooler + `cls.seq_relationship`). HF's BERT is post-LN, so a pre-LN BERT has no equivalent.


def bert_to_hf(weights: StateDict, config: ModelConfig, vocab_size: int) -> BertForMaskedLM | BertForPreTraining:
    weights = dict(weights)
    if "final_norm.weight" in weights:
        raise ValueError("this BERT is pre-LN (it has final_norm); HF's BertModel is post-LN, so it cannot be exported")
    with_sentence_order = "sentence_order_head.pooler.weight" in weights
    type_vocab_size = _take(weights, "embedding.token_type.weight", "bert", keep=True).shape[0]
    hf_config = BertConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.ffn_size,
        hidden_act="gelu",  # exact erf GELU, as our BERT blocks and head
        hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout,
        max_position_embeddings=config.seq_length, type_vocab_size=type_vocab_size,
        initializer_range=config.init_std, layer_norm_eps=config.layernorm_eps, pad_token_id=SPECIAL_IDS["pad"],
    )
    names = _bert_names(config.num_layers, with_sentence_order)
    hf_state = {hf_name: _take(weights, ours, "bert") for ours, hf_name in names}
    for layer in range(config.num_layers):
        for kind in ("weight", "bias"):
            query, key, value = _take(weights, f"blocks.{layer}.attention.qkv.{kind}", "bert").chunk(3, dim=0)
            prefix = f"bert.encoder.layer.{layer}.attention.self"
            hf_state |= {f"{prefix}.query.{kind}": query, f"{prefix}.key.{kind}": key, f"{prefix}.value.{kind}": value}
    # Tied, as in our BERT: the decoder is the word embedding and its bias is cls.predictions.bias.
    hf_state["cls.predictions.decoder.weight"] = hf_state["bert.embeddings.word_embeddings.weight"]
    hf_state["cls.predictions.decoder.bias"] = hf_state["cls.predictions.bias"]
    _check_all_taken(weights, "bert")
    model_class = BertForPreTraining if with_sentence_order else BertForMaskedLM
    return _hf_model(model_class, hf_config, hf_state)


def bert_from_hf(hf_dir: Path) -> StateDict:
    architectures = BertConfig.from_pretrained(hf_dir).architectures or []
    if not {"BertForMaskedLM", "BertForPreTraining"} & set(architectures):
        raise ValueError(
            f"{hf_dir} holds {architectures or 'an unnamed architecture'}, without BERT's masked-LM head; "
            "import a BertForMaskedLM or BertForPreTraining checkpoint"
        )
    with_sentence_order = "BertForPreTraining" in architectures
    hf_model = (BertForPreTraining if with_sentence_order else BertForMaskedLM).from_pretrained(hf_dir)
    hf_state = hf_model.state_dict()
    num_layers = hf_model.config.num_hidden_layers
    weights = {ours: _fp32(hf_state[hf_name]) for ours, hf_name in _bert_names(num_layers, with_sentence_order)}
    for layer in range(num_layers):
        prefix = f"bert.encoder.layer.{layer}.attention.self"
        for kind in ("weight", "bias"):
            parts = [hf_state[f"{prefix}.{projection}.{kind}"] for projection in ("query", "key", "value")]
            weights[f"blocks.{layer}.attention.qkv.{kind}"] = _fp32(torch.cat(parts, dim=0))
    return weights


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


# ---------------------------------------------------------------------------------------------

def _saved_with_transformers(
    to_hf: Callable[[StateDict, ModelConfig, int], PreTrainedModel],
) -> Callable[[StateDict, ModelConfig, int, Path], None]:
    def write(weights: StateDict, model_config: ModelConfig, vocab_size: int, out_dir: Path) -> None:
        to_hf(weights, model_config, vocab_size).save_pretrained(out_dir)

    return write


HF_CONVERSIONS: dict[str, HFConversion] = {
    "gpt": HFConversion(write=_saved_with_transformers(gpt_to_hf), read=gpt_from_hf),
    "bert": HFConversion(write=_saved_with_transformers(bert_to_hf), read=bert_from_hf),
}


def _adapter(family: str, model_class: str) -> HFAdapter:
    def export(state: StateDict, config: Config, out_dir: Path) -> None:
        export_hf(state, family, config.model, config.padded_vocab_size, out_dir)

    return HFAdapter(model_class=model_class, export=export, import_=lambda hf_dir: import_hf(hf_dir, family))


GPT_ADAPTER = _adapter("gpt", "GPT2LMHeadModel")
BERT_ADAPTER = _adapter("bert", "BertForMaskedLM")


def _conversion(family: str) -> HFConversion:
    if family not in HF_CONVERSIONS:
        raise ValueError(f"no Hugging Face conversion for model family {family!r}; use one of {sorted(HF_CONVERSIONS)}")
    return HF_CONVERSIONS[family]


def _take(weights: StateDict, name: str, family: str, keep: bool = False) -> torch.Tensor:
    """Remove and return `name`, so _check_all_taken can tell whether every weight was converted."""
    if name not in weights:
        raise ValueError(f"the state dict has no weight {name}; is it a full state dict of a {family} model?")
    return weights[name] if keep else weights.pop(name)


def _check_all_taken(weights: StateDict, family: str) -> None:
    if weights:
        raise ValueError(f"the state dict has weights a {family} model does not: {sorted(weights)}")


def _hf_model(model_class: type[PreTrainedModel], hf_config: object, hf_state: StateDict) -> PreTrainedModel:
    model = model_class(hf_config)
    model.load_state_dict({name: tensor.contiguous() for name, tensor in hf_state.items()}, strict=True)
    return model.eval()


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(torch.float32).contiguous().clone()
