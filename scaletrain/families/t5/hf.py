"""T5 weights to and from Hugging Face `T5ForConditionalGeneration` (safetensors + config.json).

Vocabulary: the HF `vocab_size` is our padded vocabulary, as in Google's own checkpoints
(32128 rows for a 32100-piece tokenizer); the padding rows take part in our softmax, so keeping
them makes HF's probabilities ours exactly, and the tokenizer never emits their ids.
Tying: an untied output layer is written as `lm_head.weight` next to `shared.weight` with
`tie_word_embeddings: false`, which every transformers version reads as T5 v1.1 (no output
scaling, separate head). The files are written directly rather than through an HF model's
`save_pretrained`: a transformers >= 5 T5 always shares `lm_head` with `shared` in memory and
unties them only when loading a checkpoint in which the two differ."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from scaletrain.checkpoint.hf.conversion import StateDict, fp32, weights_only
from scaletrain.checkpoint.hf.reading import REFETCH, load_checked, read_hf_config
from scaletrain.config import Config
from scaletrain.data.tokenizer import EOS, SPECIAL_IDS
from scaletrain.families.t5.model import T5Architecture
from scaletrain.families.t5.model import architecture as model_architecture
from scaletrain.model.family import HFAdapter

# The sizes read_t5_architecture takes from config.json. transformers would fill one that is absent with
# t5-small's (T5Config's defaults) and build another model than the weights'; the other keys it reads
# have defaults that are T5's own (relu, 32 buckets, 1e-6).
REQUIRED_KEYS = ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "num_layers")


def export_hf(
    state_dict: StateDict,
    architecture: T5Architecture,
    out_dir: str | Path,
    pad_token_id: int = SPECIAL_IDS["pad"],
    eos_token_id: int = SPECIAL_IDS["eos"],
) -> Path:
    """Write the full (TP=1 or merged) weights of a `T5` as a directory `from_pretrained` loads.
    The decoder starts from the pad token, as T5 and our collator do."""
    weight_map = _weight_map(architecture)
    unknown = sorted(set(weights_only(state_dict)) - set(weight_map))
    missing = sorted(set(weight_map) - set(state_dict))
    if unknown or missing:
        raise ValueError(
            f"state dict does not match the T5 architecture {architecture}: missing {missing[:3]}, "
            f"unexpected {unknown[:3]}; export the state dict of a T5 built with this architecture"
        )
    hf_weights = {}
    for name, hf_names in weight_map.items():
        for hf_name, part in zip(hf_names, state_dict[name].chunk(len(hf_names), dim=0), strict=True):
            hf_weights[hf_name] = part.detach().to("cpu", torch.float32).contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf_weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = _hf_config(architecture, pad_token_id, eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict (parameters only) from a `T5ForConditionalGeneration` directory, read through
    transformers (checked, reading.py): its model holds `lm_head` also where the files leave it to be tied
    (transformers >= 5 saves an untied v1.1 so)."""
    from transformers import T5ForConditionalGeneration  # here: exporting T5 needs no transformers

    hf_dir = Path(hf_dir)
    architecture = read_t5_architecture(hf_dir)  # first: a config.json without a size is refused naming it
    hf_weights = load_checked(T5ForConditionalGeneration, hf_dir).state_dict()
    return {name: fp32(torch.cat([hf_weights[hf_name] for hf_name in hf_names], dim=0))
            for name, hf_names in _weight_map(architecture).items()}


def read_t5_architecture(hf_dir: str | Path) -> T5Architecture:
    """The `T5Architecture` of a Hugging Face T5 config.json, which must set each of REQUIRED_KEYS."""
    config = read_hf_config(Path(hf_dir))
    unset = [key for key in REQUIRED_KEYS if config.get(key) is None]
    if unset:
        raise ValueError(f"{Path(hf_dir) / 'config.json'} sets no {unset[0]}; a T5 config.json sets "
                         f"{', '.join(REQUIRED_KEYS)} (as save_pretrained writes them): {REFETCH}")
    activation = config.get("feed_forward_proj", "relu")
    if activation not in ("relu", "gated-gelu"):
        raise ValueError(f"{hf_dir}: feed_forward_proj={activation!r} is not supported; T5 uses relu or gated-gelu")
    # transformers >= 5 always writes tie_word_embeddings=true and records v1.1's untied,
    # unscaled head as scale_decoder_outputs=false.
    tied = config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True))
    return T5Architecture(
        vocab_size=config["vocab_size"],
        hidden_size=config["d_model"],
        num_heads=config["num_heads"],
        head_dim=config["d_kv"],
        ffn_hidden_size=config["d_ff"],
        num_encoder_layers=config["num_layers"],
        num_decoder_layers=config.get("num_decoder_layers") or config["num_layers"],
        ffn_activation=activation,
        tie_embeddings=tied,
        relative_attention_num_buckets=config.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=config.get("relative_attention_max_distance", 128),
        layernorm_eps=config.get("layer_norm_epsilon", 1e-6),
    )


def _weight_map(architecture: T5Architecture) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the HF weights whose concatenation along dim 0 it is (fused Q/K/V,
    K/V and wi_0/wi_1; HF keeps each stack's relative-position table in its block 0)."""
    weight_map = {"embedding.weight": ("shared.weight",)}
    for stack, num_layers in (("encoder", architecture.num_encoder_layers),
                              ("decoder", architecture.num_decoder_layers)):
        weight_map[f"{stack}.relative_position_bias.weight"] = (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        )
        for index in range(num_layers):
            ours, hf = f"{stack}.layers.{index}", f"{stack}.block.{index}.layer"
            weight_map |= {
                f"{ours}.attention_norm.weight": (f"{hf}.0.layer_norm.weight",),
                f"{ours}.attention.qkv.weight": tuple(f"{hf}.0.SelfAttention.{p}.weight" for p in "qkv"),
                f"{ours}.attention.output.weight": (f"{hf}.0.SelfAttention.o.weight",),
            }
            if stack == "decoder":
                weight_map |= {
                    f"{ours}.cross_attention_norm.weight": (f"{hf}.1.layer_norm.weight",),
                    f"{ours}.cross_attention.query.weight": (f"{hf}.1.EncDecAttention.q.weight",),
                    f"{ours}.cross_attention.key_value.weight": tuple(
                        f"{hf}.1.EncDecAttention.{p}.weight" for p in "kv"
                    ),
                    f"{ours}.cross_attention.output.weight": (f"{hf}.1.EncDecAttention.o.weight",),
                }
            ffn = f"{hf}.{2 if stack == 'decoder' else 1}"
            wi_parts = ("wi_0", "wi_1") if architecture.ffn_activation == "gated-gelu" else ("wi",)
            weight_map |= {
                f"{ours}.mlp_norm.weight": (f"{ffn}.layer_norm.weight",),
                f"{ours}.mlp.fc.weight": tuple(f"{ffn}.DenseReluDense.{part}.weight" for part in wi_parts),
                f"{ours}.mlp.proj.weight": (f"{ffn}.DenseReluDense.wo.weight",),
            }
        weight_map[f"{stack}.final_norm.weight"] = (f"{stack}.final_layer_norm.weight",)
    if not architecture.tie_embeddings:
        weight_map["lm_head.weight"] = ("lm_head.weight",)
    return weight_map


def _hf_config(architecture: T5Architecture, pad_token_id: int, eos_token_id: int) -> dict:
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": architecture.vocab_size,
        "d_model": architecture.hidden_size,
        "d_kv": architecture.head_dim,
        "d_ff": architecture.ffn_hidden_size,
        "num_layers": architecture.num_encoder_layers,
        "num_decoder_layers": architecture.num_decoder_layers,
        "num_heads": architecture.num_heads,
        "relative_attention_num_buckets": architecture.relative_attention_num_buckets,
        "relative_attention_max_distance": architecture.relative_attention_max_distance,
        "feed_forward_proj": architecture.ffn_activation,
        "tie_word_embeddings": architecture.tie_embeddings,
        "layer_norm_epsilon": architecture.layernorm_eps,
        "dropout_rate": architecture.dropout,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "decoder_start_token_id": pad_token_id,
    }


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, model_architecture(config), out_dir)


ADAPTER = HFAdapter(
    model_class="T5ForConditionalGeneration",
    export=_export,
    import_=import_hf,
    # data/seq2seq.py and families/t5/span_corruption.py end the encoder's text with an eos.
    text_framing=(f"$A {EOS}", f"$A {EOS} $B {EOS}"),
)
