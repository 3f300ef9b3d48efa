"""Llama-family weights to and from Hugging Face `LlamaForCausalLM` (Touvron et al. 2023; Dubey et al. 2024),
or `MistralForCausalLM` (Jiang et al. 2023) for a model with a sliding window, and `MixtralForCausalLM`
(Jiang et al. 2024) for one whose every MLP is a mixture of experts.

Our blocks compute what HF's do with the same matrices: RMSNorm, rotate-half rotary embeddings (so
q/k rows need no permutation), grouped-query attention, SwiGLU, no biases, an untied output layer.
Only the fusion differs: with num_kv_heads == num_heads our `attention.qkv` is [q; k; v], otherwise
`attention.query` is q and `attention.key_value` is [k; v]; `mlp.fc` is [gate; up]. As for GPT, the
HF vocabulary is our padded one (conversion.py explains why). Import takes plain rotary embeddings
only: rope scaling (Llama 3.1's long context) is not in our model, so it is refused, not dropped.

Mistral is Llama's architecture with the same weight names plus a sliding window, whose mask and rolling
cache transformers builds as ours do (model/attention_masks.py): a llama with model.sliding_window exports
as `MistralForCausalLM`, and a Mistral checkpoint imports as llama weights (train it with the
sliding_window of its config.json; Mistral 7B v0.1 has 4096, later versions none).

Mixtral: our `mlp.router` is HF's `mlp.gate`; expert e's `mlp.experts.e.fc` ([gate; up]) and `.proj` are
row e of HF's stacked `experts.gate_up_proj` ([E, 2f, h], gate then up) and `experts.down_proj` (save_pretrained
writes them as the Hub's per-expert w1/w3/w2). Both route the same way (softmax, top-k, renormalised
for k > 1), dropless: a model trained with a capacity factor exports the same weights, which transformers
runs without drops. HF's load-balancing loss is top_k times ours (model/moe.py), so its coefficient is ours / k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scaletrain.checkpoint.hf.conversion import StateDict, check_all_taken, fp32, take, weights_only
from scaletrain.checkpoint.hf.reading import load_checked, read_hf_config
from scaletrain.config import Config, ModelConfig
from scaletrain.data.tokenizer import EOS, SPECIAL_IDS
from scaletrain.model.family import HFAdapter

if TYPE_CHECKING:  # transformers is imported by the functions that convert (1.6 s)
    from transformers import LlamaConfig, MistralConfig, MixtralConfig

FAMILY = "llama"
MODEL_CLASSES = {  # transformers' class per config.json model_type, imported on use (1.6 s)
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
}


@dataclass(frozen=True)
class LlamaShape:
    """The sizes that fix every weight's name and shape, from our config or from HF's config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # the dense MLP's, or one expert's
    num_experts: int = 0  # 0: dense (LlamaForCausalLM); else every MLP is a mixture (MixtralForCausalLM)

    @classmethod
    def from_model_config(cls, config: ModelConfig, vocab_size: int) -> LlamaShape:
        moe = config.moe
        if moe.enabled and moe.every != 1:
            raise ValueError(f"model.moe.every={moe.every}: transformers' MixtralForCausalLM has experts in every "
                             "layer; only model.moe.every=1 exports")
        if moe.enabled and moe.top_k == 1:
            raise ValueError("model.moe.top_k=1: MixtralForCausalLM renormalises the top-k weights, which at k=1 "
                             "makes every weight 1 where ours is the router probability (Switch); use top_k >= 2 "
                             "to export")
        return cls(vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
                   config.attention_head_dim, moe.layer_ffn(0, config.ffn_size), moe.num_experts)  # every=1 above

    @classmethod
    def from_hf_config(cls, hf_config: LlamaConfig | MixtralConfig) -> LlamaShape:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return cls(hf_config.vocab_size, hf_config.hidden_size, hf_config.num_hidden_layers,
                   hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads,
                   head_dim, hf_config.intermediate_size, getattr(hf_config, "num_local_experts", 0))


def export_hf(state: StateDict, config: ModelConfig, vocab_size: int, out_dir: str | Path) -> Path:
    """Write `out_dir` (config.json + safetensors) from our TP=1 weights, each checked for name and shape first.
    The HF model is built on the meta device and handed our tensors (assign=True), so a 70B export holds its
    weights once and skips a random init; its rotary tables stay on meta, as save_pretrained never writes them."""
    import transformers

    shape = LlamaShape.from_model_config(config, vocab_size)
    hf_state = _hf_state(weights_only(state), shape)
    hf_config = _hf_config(config, vocab_size, shape)
    with torch.device("meta"):
        model = getattr(transformers, MODEL_CLASSES[hf_config.model_type])(hf_config)
    model.load_state_dict(hf_state, strict=True, assign=True)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict from a `LlamaForCausalLM`, `MistralForCausalLM` or `MixtralForCausalLM`
    directory; tied HF
    embeddings become two equal weights."""
    import transformers

    hf_dir = Path(hf_dir)
    model_class = getattr(transformers, MODEL_CLASSES[_check_supported(hf_dir)])
    hf_model = load_checked(model_class, hf_dir)
    hf_state = hf_model.state_dict()
    shape = LlamaShape.from_hf_config(hf_model.config)
    state = {
        ours: fp32(torch.cat([hf_state[hf_name] for hf_name in hf_names], dim=0))
        for ours, (hf_names, _) in _weight_layout(shape).items()
    }
    for hf_name, (ours_per_expert, _) in _expert_layout(shape).items():
        state |= {ours: fp32(hf_state[hf_name][expert]) for expert, ours in enumerate(ours_per_expert)}
    return state


def _hf_state(weights: StateDict, shape: LlamaShape) -> StateDict:
    """HF's weights from ours, split where we fuse; one error naming the first missing, extra or misshapen weight."""
    weights = dict(weights)
    hf_state = {}
    for ours, (hf_names, expected) in _weight_layout(shape).items():
        tensor = take(weights, ours, FAMILY)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"the state dict's {ours} has shape {list(tensor.shape)} but this llama config needs {list(expected)}; "
                f"export with the config and padded vocabulary ({shape.vocab_size}) the model was trained with"
            )
        for hf_name, part in zip(hf_names, tensor.chunk(len(hf_names), dim=0), strict=True):
            hf_state[hf_name] = part.detach().to("cpu", torch.float32).contiguous()
    for hf_name, (ours_per_expert, expected) in _expert_layout(shape).items():
        experts = [take(weights, ours, FAMILY) for ours in ours_per_expert]
        if any(tuple(expert.shape) != expected for expert in experts):
            raise ValueError(
                f"the state dict's {ours_per_expert[0]} has shape {list(experts[0].shape)} but this config's experts "
                f"need {list(expected)}; export with the config the model was trained with"
            )
        hf_state[hf_name] = torch.stack(experts).detach().to("cpu", torch.float32).contiguous()
    check_all_taken(weights, FAMILY)
    return hf_state


def _weight_layout(shape: LlamaShape) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Our name -> (the HF weights whose concatenation along dim 0 it is, its shape)."""
    h, d, f, vocab = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size, shape.vocab_size
    q_rows, kv_rows = shape.num_heads * d, shape.num_kv_heads * d
    layout = {
        "embedding.word.weight": (("model.embed_tokens.weight",), (vocab, h)),
        "final_norm.weight": (("model.norm.weight",), (h,)),
        "output.weight": (("lm_head.weight",), (vocab, h)),
    }
    for layer in range(shape.num_layers):
        ours, hf = f"blocks.{layer}", f"model.layers.{layer}"
        q, k, v = (f"{hf}.self_attn.{projection}.weight" for projection in ("q_proj", "k_proj", "v_proj"))
        if shape.num_kv_heads == shape.num_heads:
            attention = {f"{ours}.attention.qkv.weight": ((q, k, v), (3 * q_rows, h))}
        else:
            attention = {
                f"{ours}.attention.query.weight": ((q,), (q_rows, h)),
                f"{ours}.attention.key_value.weight": ((k, v), (2 * kv_rows, h)),
            }
        if shape.num_experts:
            mlp = {f"{ours}.mlp.router.weight": ((f"{hf}.mlp.gate.weight",), (shape.num_experts, h))}
        else:
            mlp = {
                f"{ours}.mlp.fc.weight": ((f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), (2 * f, h)),
                f"{ours}.mlp.proj.weight": ((f"{hf}.mlp.down_proj.weight",), (h, f)),
            }
        layout |= {
            f"{ours}.attention_norm.weight": ((f"{hf}.input_layernorm.weight",), (h,)),
            **attention,
            f"{ours}.attention.output.weight": ((f"{hf}.self_attn.o_proj.weight",), (h, q_rows)),
            f"{ours}.mlp_norm.weight": ((f"{hf}.post_attention_layernorm.weight",), (h,)),
            **mlp,
        }
    return layout


def _expert_layout(shape: LlamaShape) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """Mixtral's stacked expert weights: HF name -> (our per-expert names, in expert order; one expert's shape)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    layout = {}
    for layer in range(shape.num_layers if shape.num_experts else 0):
        ours, hf = f"blocks.{layer}.mlp.experts", f"model.layers.{layer}.mlp.experts"
        layout[f"{hf}.gate_up_proj"] = ([f"{ours}.{e}.fc.weight" for e in range(shape.num_experts)], (2 * f, h))
        layout[f"{hf}.down_proj"] = ([f"{ours}.{e}.proj.weight" for e in range(shape.num_experts)], (h, f))
    return layout


def _hf_config(config: ModelConfig, vocab_size: int, shape: LlamaShape) -> LlamaConfig | MistralConfig | MixtralConfig:
    """Mixtral's config for a mixture of experts (with its window, if any), else Mistral's (no bias switches:
    it has none) when the model has a sliding window, else Llama's."""
    from transformers import LlamaConfig, MistralConfig, MixtralConfig

    shared = dict(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.attention_head_dim,
        max_position_embeddings=config.seq_length, rms_norm_eps=config.layernorm_eps, hidden_act="silu",
        tie_word_embeddings=False, initializer_range=config.init_std, attention_dropout=config.dropout,
        bos_token_id=SPECIAL_IDS["bos"], eos_token_id=SPECIAL_IDS["eos"],
    )
    if shape.num_experts:
        moe = config.moe
        return MixtralConfig(
            **shared, rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
            sliding_window=config.sliding_window, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coeff / moe.top_k, output_router_logits=False, router_jitter_noise=0.0,
        )
    if config.sliding_window is not None:
        return MistralConfig(**shared, rope_theta=float(config.rope_theta), sliding_window=config.sliding_window)
    return LlamaConfig(**shared, rope_theta=float(config.rope_theta), attention_bias=False, mlp_bias=False)


def _check_supported(hf_dir: Path) -> str:
    """Refuse, naming the config.json key, a Llama variant whose weights our blocks would compute differently;
    the model_type, llama, mistral or mixtral, of one we can read."""
    config_file, hf_config = hf_dir / "config.json", read_hf_config(hf_dir)
    # transformers < 5 writes rope_scaling (null when plain); 5 writes rope_parameters with a rope_type.
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"{config_file} has model_type={model_type!r}; scaletrain's llama family reads "
                         f"{' or '.join(map(repr, MODEL_CLASSES))}")
    unsupported = {
        "hidden_act": (hf_config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf_config.get("attention_bias", False), False),
        "mlp_bias": (hf_config.get("mlp_bias", False), False),
        "rope_type": (rope.get("rope_type", rope.get("type", "default")), "default"),
    }
    for key, (found, supported) in unsupported.items():
        if found != supported:
            raise ValueError(
                f"{config_file} has {key}={found!r}; scaletrain's llama family supports only {key}={supported!r}"
            )
    return model_type


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, config.model, config.padded_vocab_size, out_dir)


ADAPTER = HFAdapter(
    model_class="LlamaForCausalLM",
    export=_export,
    import_=import_hf,
    # data/dataset.py packs documents behind an eos, and `scaletrain generate` prompts so.
    text_framing=(f"{EOS} $A", f"{EOS} $A {EOS} $B"),
)
