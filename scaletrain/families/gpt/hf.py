"""GPT weights to and from Hugging Face `GPT2LMHeadModel` (Radford et al. 2019).

GPT-2's Conv1D stores weights as [in, out], the transpose of our linear layers; its c_attn is our
fused [Q; K; V] as is. The HF vocabulary is our padded one (conversion.py explains why).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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
from scaletrain.config import Config, ModelConfig
from scaletrain.data.tokenizer import EOS, SPECIAL_IDS
from scaletrain.model.family import HFAdapter

if TYPE_CHECKING:  # transformers is imported by the functions that convert (1.6 s)
    from transformers import GPT2LMHeadModel

FAMILY = "gpt"


def export_hf(state: StateDict, config: ModelConfig, vocab_size: int, out_dir: str | Path) -> Path:
    """Write `out_dir` (config.json + model.safetensors) loadable with `from_pretrained(out_dir)`.
    vocab_size is the padded vocabulary the model was built with (`Config.padded_vocab_size`)."""
    if config.sliding_window is not None:
        raise ValueError(
            f"this gpt model attends through a sliding window (model.sliding_window={config.sliding_window}), which "
            "GPT2LMHeadModel cannot: transformers has no GPT-2 model type with one, and its full attention would "
            "compute other logits. Export a llama with model.sliding_window instead (as MistralForCausalLM), "
            "or use the run's checkpoints with `scaletrain generate`"
        )
    weights = weights_only(state)
    check_vocabulary_rows(weights, "embedding.word.weight", vocab_size)
    to_hf(weights, config, vocab_size).save_pretrained(out_dir)
    return Path(out_dir)


def import_hf(hf_dir: str | Path) -> StateDict:
    """Our TP=1 state dict from a `GPT2LMHeadModel` directory."""
    from transformers import GPT2LMHeadModel

    model = load_checked(GPT2LMHeadModel, hf_dir)
    hf_state = model.state_dict()
    return {
        ours: fp32(hf_state[hf_name].t() if transposed else hf_state[hf_name])
        for ours, hf_name, transposed in _gpt2_names(model.config.n_layer)
    }


def to_hf(weights: StateDict, config: ModelConfig, vocab_size: int) -> GPT2LMHeadModel:
    """The `GPT2LMHeadModel` holding `weights`, every one of which must have its place in it."""
    from transformers import GPT2Config, GPT2LMHeadModel

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
        tensor = take(weights, ours, FAMILY)
        hf_state[hf_name] = tensor.t() if transposed else tensor
    hf_state["lm_head.weight"] = hf_state["transformer.wte.weight"]  # tied, as in our GPT
    check_all_taken(weights, FAMILY)
    return hf_model(GPT2LMHeadModel, hf_config, hf_state)


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


def _export(state: StateDict, config: Config, out_dir: Path) -> None:
    export_hf(state, config.model, config.padded_vocab_size, out_dir)


ADAPTER = HFAdapter(
    model_class="GPT2LMHeadModel",
    export=_export,
    import_=import_hf,
    # data/dataset.py packs documents behind an eos, and `scaletrain generate` prompts so.
    text_framing=(f"{EOS} $A", f"{EOS} $A {EOS} $B"),
)
