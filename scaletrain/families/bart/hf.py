"""BART weights to and from Hugging Face `BartForConditionalGeneration`.

HF splits our fused [Q; K; V] (and the cross-attention's [K; V]) in parts and names the blocks'
norms after what precedes them; the shared table is `model.shared`, which HF ties to both stacks'
`embed_tokens` and to `lm_head`. The vocabulary is our padded one (conversion.py explains why)
and the ids are our tokenizer's: the decoder starts from eos (families/bart/noising.py), written as
`decoder_start_token_id`, and generation forces no bos or eos, as `scaletrain generate` does not.
HF's `final_logits_bias` is our zero buffer: exported as zeros, and an import refuses a checkpoint
whose bias is not zero, since this BART never trains one.
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
from scaletrain.checkpoint.hf.reading import load_checked
from scaletrain.config import Config
from scaletrain.data.tokenizer import EOS, SPECIAL_IDS
from scaletrain.families.bart.model import BartArchitecture
from scaletrain.families.bart.model import architecture as model_architecture
from scaletrain.model.family import HFAdapter

if TYPE_CHECKING:  # transformers is imported by the functions that convert (1.6 s)
    from transformers import BartConfig

FAMILY = "bart"
HF_LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default, which BartEncoderLayer and BartDecoderLayer keep
TIED_TO_SHARED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")


def export_hf(state: StateDict, architecture: BartArchitecture, out_dir: str | Path) -> Path:
    """Write `out_dir` (config.json, generation_config.json, model.safetensors) loadable with
    `BartForConditionalGeneration.from_pretrained(out_dir)`, from a full (TP=1 or merged) state."""
    from transformers import BartForConditionalGeneration

    if architecture.layernorm_eps != HF_LAYERNORM_EPS:
        raise ValueError(f"model.layernorm_eps={architecture.layernorm_eps}, but HF's BART LayerNorms use "
                         f"{HF_LAYERNORM_EPS}; train with model.layernorm_eps={HF_LAYERNORM_EPS} to export")
    weights = dict(weights_only(state))
    check_vocabulary_rows(weights, "embedding.weight", architecture.vocab_size)
    hf_state = {}
    for ours, hf_names in _weight_map(architecture).items():
        parts = take(weights, ours, FAMILY).chunk(len(hf_names), dim=0)
        hf_state |= dict(zip(hf_names, parts, strict=True))
    check_all_taken(weights, FAMILY)
    hf_state |= {name: hf_state["model.shared.weight"] for name in TIED_TO_SHARED}
    hf_state["final_logits_bias"] = torch.zeros(1, architecture.vocab_size)
    hf_model(BartForConditionalGeneration, hf_config(architecture), hf_state).save_pretrained(out_dir)
    return Path(out_dir)


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict from a `BartForConditionalGeneration` directory."""
    from transformers import BartForConditionalGeneration

    model = load_checked(BartForConditionalGeneration, hf_dir)
    if model.final_logits_bias.any():
        raise ValueError(f"{hf_dir} has a nonzero final_logits_bias; scaletrain's BART keeps it at zero (as BART's "
                         "pretraining does), so it cannot hold this model")
    hf_state = model.state_dict()
    return {ours: fp32(torch.cat([hf_state[name] for name in hf_names], dim=0))
            for ours, hf_names in _weight_map(read_bart_architecture(hf_dir)).items()}


def read_bart_architecture(hf_dir: str | Path) -> BartArchitecture:
    """The `BartArchitecture` of a Hugging Face BART config.json."""
    from transformers import BartConfig

    config = BartConfig.from_pretrained(hf_dir)
    ffn_sizes = (config.encoder_ffn_dim, config.decoder_ffn_dim)
    if config.scale_embedding or config.activation_function != "gelu" or ffn_sizes[0] != ffn_sizes[1]:
        raise ValueError(f"{hf_dir}: scale_embedding={config.scale_embedding}, activation_function="
                         f"{config.activation_function!r}, FFN sizes {ffn_sizes}; scaletrain's BART has unscaled "
                         "embeddings, exact gelu and one FFN size (as BART's)")
    if config.encoder_attention_heads != config.decoder_attention_heads:
        raise ValueError(f"{hf_dir}: encoder and decoder head counts differ; scaletrain's BART has one head count")
    return BartArchitecture(
        vocab_size=config.vocab_size, hidden_size=config.d_model, num_heads=config.encoder_attention_heads,
        ffn_hidden_size=config.encoder_ffn_dim, num_encoder_layers=config.encoder_layers,
        num_decoder_layers=config.decoder_layers, max_position_embeddings=config.max_position_embeddings,
        init_std=config.init_std, dropout=config.dropout,
    )


def hf_config(architecture: BartArchitecture) -> BartConfig:
    """BartConfig of `architecture` with our tokenizer's ids (data/tokenizer.py SPECIAL_IDS)."""
    from transformers import BartConfig

    return BartConfig(
        vocab_size=architecture.vocab_size, d_model=architecture.hidden_size,
        encoder_layers=architecture.num_encoder_layers, decoder_layers=architecture.num_decoder_layers,
        encoder_attention_heads=architecture.num_heads, decoder_attention_heads=architecture.num_heads,
        encoder_ffn_dim=architecture.ffn_hidden_size, decoder_ffn_dim=architecture.ffn_hidden_size,
        max_position_embeddings=architecture.max_position_embeddings, activation_function="gelu",
        dropout=architecture.dropout, attention_dropout=architecture.dropout,
        activation_dropout=architecture.dropout, init_std=architecture.init_std, scale_embedding=False,
        pad_token_id=SPECIAL_IDS["pad"], bos_token_id=SPECIAL_IDS["bos"], eos_token_id=SPECIAL_IDS["eos"],
        decoder_start_token_id=SPECIAL_IDS["eos"], forced_eos_token_id=None, tie_word_embeddings=True,
        architectures=["BartForConditionalGeneration"],
    )


def _weight_map(architecture: BartArchitecture) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the HF weights whose concatenation along dim 0 it is."""
    weight_map = {"embedding.weight": ("model.shared.weight",)}
    for stack, num_layers in (("encoder", architecture.num_encoder_layers),
                              ("decoder", architecture.num_decoder_layers)):
        hf_stack = f"model.{stack}"
        weight_map[f"{stack}.positions.weight"] = (f"{hf_stack}.embed_positions.weight",)
        modules = [(f"{stack}.embedding_norm", f"{hf_stack}.layernorm_embedding")]
        for index in range(num_layers):
            ours, hf = f"{stack}.layers.{index}", f"{hf_stack}.layers.{index}"
            modules += [(f"{ours}.attention.output", f"{hf}.self_attn.out_proj"),
                        (f"{ours}.attention_norm", f"{hf}.self_attn_layer_norm"),
                        (f"{ours}.mlp.fc", f"{hf}.fc1"), (f"{ours}.mlp.proj", f"{hf}.fc2"),
                        (f"{ours}.mlp_norm", f"{hf}.final_layer_norm")]
            fused = [(f"{ours}.attention.qkv", [f"{hf}.self_attn.{p}_proj" for p in "qkv"])]
            if stack == "decoder":
                modules += [(f"{ours}.cross_attention.query", f"{hf}.encoder_attn.q_proj"),
                            (f"{ours}.cross_attention.output", f"{hf}.encoder_attn.out_proj"),
                            (f"{ours}.cross_attention_norm", f"{hf}.encoder_attn_layer_norm")]
                fused.append((f"{ours}.cross_attention.key_value", [f"{hf}.encoder_attn.{p}_proj" for p in "kv"]))
            for kind in ("weight", "bias"):
                weight_map |= {f"{name}.{kind}": tuple(f"{part}.{kind}" for part in parts) for name, parts in fused}
        for kind in ("weight", "bias"):
            weight_map |= {f"{ours}.{kind}": (f"{hf_name}.{kind}",) for ours, hf_name in modules}
    return weight_map


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, model_architecture(config), out_dir)


ADAPTER = HFAdapter(
    model_class="BartForConditionalGeneration",
    export=_export,
    import_=import_hf,
    # families/bart/noising.py ends the encoder's text with an eos.
    text_framing=(f"$A {EOS}", f"$A {EOS} $B {EOS}"),
)
