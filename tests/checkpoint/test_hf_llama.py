"""Llama export/import: `LlamaForCausalLM` loads what we write and computes what a plain-PyTorch forward of our
state dict computes; import inverts export; bad weights fail naming them; the size configs have the published
parameter counts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from scaletrain.config import _read_yaml_with_bases
from scaletrain.families.llama.hf import export_hf, import_hf
from scaletrain.model.moe import MoEConfig

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 384  # padded: 3 x 128


@dataclass(frozen=True)
class LlamaModelConfig:
    """The attributes the converter reads from our llama config section (the contract with families/llama/model.py),
    standing in for that section until config.py has it."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    ffn_hidden_size: int = 96
    seq_length: int = 32
    layernorm_eps: float = 1e-5
    rope_theta: float = 500000.0
    init_std: float = 0.02
    dropout: float = 0.0
    family: str = "llama"
    moe: MoEConfig = field(default_factory=MoEConfig)
    sliding_window: int | None = None  # a window exports as MistralForCausalLM (test_hf_mistral.py)

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size


VARIANTS = {
    "gqa": LlamaModelConfig(),
    "mha": LlamaModelConfig(num_kv_heads=4, rope_theta=10000.0),
    "gqa_wide_heads": LlamaModelConfig(num_kv_heads=1, head_dim=32),  # nh * d = 128 != hidden
}


def random_state_dict(config: LlamaModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights in our names with the contract's shapes; scaled so every layer changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    h, d, f = config.hidden_size, config.attention_head_dim, config.ffn_size
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d

    def matrix(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, generator=generator) / math.sqrt(columns)

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(h, generator=generator)

    state = {"embedding.word.weight": torch.randn(VOCAB_SIZE, h, generator=generator)}
    for layer in range(config.num_layers):
        block = f"blocks.{layer}"
        state[f"{block}.attention_norm.weight"] = norm()
        if config.num_kv_heads == config.num_heads:
            state[f"{block}.attention.qkv.weight"] = matrix(3 * q_rows, h)
        else:
            state[f"{block}.attention.query.weight"] = matrix(q_rows, h)
            state[f"{block}.attention.key_value.weight"] = matrix(2 * kv_rows, h)
        state[f"{block}.attention.output.weight"] = matrix(h, q_rows)
        state[f"{block}.mlp_norm.weight"] = norm()
        state[f"{block}.mlp.fc.weight"] = matrix(2 * f, h)
        state[f"{block}.mlp.proj.weight"] = matrix(h, f)
    state["final_norm.weight"] = norm()
    state["output.weight"] = matrix(VOCAB_SIZE, h)
    return state


def reference_logits(state: dict[str, torch.Tensor], config: LlamaModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Llama's forward written out from our state dict (Touvron et al. 2023a, sec. 2: pre-RMSNorm, SwiGLU,
    rotary embeddings; Ainslie et al. 2023: grouped-query attention)."""
    batch, length = tokens.shape
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.attention_head_dim
    cos, sin = _rotary_tables(length, d, config.rope_theta)
    x = state["embedding.word.weight"][tokens]
    for layer in range(config.num_layers):
        block = f"blocks.{layer}"
        normed = _rms_norm(x, state[f"{block}.attention_norm.weight"], config.layernorm_eps)
        if kv_heads == heads:
            q, k, v = (normed @ state[f"{block}.attention.qkv.weight"].T).chunk(3, dim=-1)
        else:
            q = normed @ state[f"{block}.attention.query.weight"].T
            k, v = (normed @ state[f"{block}.attention.key_value.weight"].T).chunk(2, dim=-1)
        q = q.view(batch, length, heads, d).transpose(1, 2)
        k, v = (t.view(batch, length, kv_heads, d).transpose(1, 2) for t in (k, v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        # Query head i reads key/value head i // (heads / kv_heads).
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attended.transpose(1, 2).reshape(batch, length, heads * d) @ state[f"{block}.attention.output.weight"].T
        normed = _rms_norm(x, state[f"{block}.mlp_norm.weight"], config.layernorm_eps)
        gate, up = (normed @ state[f"{block}.mlp.fc.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ state[f"{block}.mlp.proj.weight"].T
    return _rms_norm(x, state["final_norm.weight"], config.layernorm_eps) @ state["output.weight"].T


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotary_tables(length: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoFormer's angles (Su et al. 2021) in the rotate-half layout: frequency j drives dims j and j + d/2."""
    inverse_frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inverse_frequencies[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    out_root = tmp_path_factory.mktemp("hf_llama")
    results = {}
    for name, config in VARIANTS.items():
        state = random_state_dict(config)
        export_hf(state, config, VOCAB_SIZE, out_root / name)
        results[name] = (out_root / name, state)
    return results


@pytest.mark.parametrize("variant", VARIANTS)
def test_hugging_face_loads_every_weight_and_import_inverts_export(exported: dict, variant: str):
    hf_dir, state = exported[variant]
    _, loading_info = LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"]
    assert not loading_info["mismatched_keys"]
    imported = import_hf(hf_dir)
    assert imported.keys() == state.keys()
    for name, weight in state.items():
        assert imported[name].dtype == torch.float32
        assert torch.equal(imported[name], weight), f"{name} changed in the round trip"


@pytest.mark.parametrize("variant", VARIANTS)
def test_hugging_face_computes_the_reference_logits(exported: dict, variant: str):
    hf_dir, state = exported[variant]
    config = VARIANTS[variant]
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert hf_config["num_key_value_heads"] == config.num_kv_heads
    assert hf_config["head_dim"] == config.attention_head_dim and not hf_config["tie_word_embeddings"]
    tokens = torch.randint(0, VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(1))
    hf_model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        hf_logits = hf_model(input_ids=tokens).logits
        ours = reference_logits(state, config, tokens)
    assert hf_logits.shape == (2, 24, VOCAB_SIZE)
    assert ours.std() > 0.5  # the layers did something, so a swapped weight would show
    assert (hf_logits - ours).abs().max() <= 1e-5


def test_reference_depends_on_rope_theta(exported: dict):
    """The 1e-5 agreement above would not hold for the wrong theta, so the exported theta is checked too."""
    _, state = exported["gqa"]
    tokens = torch.arange(24)[None, :]
    config = VARIANTS["gqa"]
    other = reference_logits(state, replace(config, rope_theta=10000.0), tokens)
    assert (reference_logits(state, config, tokens) - other).abs().max() > 1e-3


def test_tied_hugging_face_model_imports_as_equal_embedding_and_output(tmp_path: Path):
    hf_config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config).save_pretrained(tmp_path)
    imported = import_hf(tmp_path)
    assert torch.equal(imported["output.weight"], imported["embedding.word.weight"])
    assert imported["output.weight"].data_ptr() != imported["embedding.word.weight"].data_ptr()


def _without(state: dict, name: str) -> dict:
    return {key: value for key, value in state.items() if key != name}


def _with_vocab_rows(state: dict, name: str, rows: int) -> dict:
    return {**state, name: state[name][:rows]}


BAD_STATES = {
    "missing": (lambda state: _without(state, "blocks.1.mlp.proj.weight"), "no weight blocks.1.mlp.proj.weight"),
    "extra": (lambda state: {**state, "blocks.0.attention.output.bias": torch.zeros(64)},
              r"does not: \['blocks.0.attention.output.bias'\]"),
    "embedding_rows": (lambda state: _with_vocab_rows(state, "embedding.word.weight", 320),
                       r"embedding.word.weight has shape \[320, 64\] but this llama config needs \[384, 64\]"),
    "output_rows": (lambda state: _with_vocab_rows(state, "output.weight", 383),
                    r"output.weight has shape \[383, 64\]"),
    "mha_names_for_gqa": (lambda state: random_state_dict(VARIANTS["mha"]), "no weight blocks.0.attention.query"),
}


@pytest.mark.parametrize("case", BAD_STATES)
def test_export_rejects_bad_weights_naming_them(case: str, tmp_path: Path):
    corrupt, message = BAD_STATES[case]
    with pytest.raises(ValueError, match=message):
        export_hf(corrupt(random_state_dict(VARIANTS["gqa"])), VARIANTS["gqa"], VOCAB_SIZE, tmp_path)
    assert not any(tmp_path.iterdir())


UNSUPPORTED_CONFIGS = {
    "rope_scaling": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "rope_parameters": None}, "rope_type='llama3'"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=True"),
    "model_type": ({"model_type": "qwen2"}, "model_type='qwen2'; scaletrain's llama family reads 'llama' or "
                                            "'mistral'"),
}


@pytest.mark.parametrize("case", UNSUPPORTED_CONFIGS)
def test_import_rejects_variants_our_blocks_do_not_compute(exported: dict, case: str, tmp_path: Path):
    hf_dir, _ = exported["gqa"]
    changes, message = UNSUPPORTED_CONFIGS[case]
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()), **changes}))
    (tmp_path / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match=f"config.json has {message}"):
        import_hf(tmp_path)


def test_import_names_a_missing_weight_and_a_missing_config(exported: dict, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    hf_dir, _ = exported["gqa"]
    weights = load_file(hf_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="config.json does not exist"):
        import_hf(tmp_path)
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="has no tensor model.layers.1.mlp.up_proj.weight"):
        import_hf(tmp_path)


# Published sizes: the parameter counts of Meta's Hugging Face checkpoints (untied output layer).
PUBLISHED_PARAMETERS = {
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
}
PUBLISHED_VOCABULARY = {"llama2": 32000, "llama3": 128256}


@pytest.mark.parametrize("name", PUBLISHED_PARAMETERS)
def test_size_configs_have_the_published_parameter_counts(name: str):
    raw = _read_yaml_with_bases(REPO / "configs" / f"{name}.yaml", seen=())
    model, vocab = raw["model"], raw["data"]["vocab_size"]
    assert model["family"] == "llama" and vocab == PUBLISHED_VOCABULARY[name.split("_")[0]]
    multiple = model["vocab_divisible_by"]
    assert math.ceil(vocab / multiple) * multiple == vocab, "the padded vocabulary must be the published one"
    h, heads, kv_heads, ffn = model["hidden_size"], model["num_heads"], model["num_kv_heads"], model["ffn_hidden_size"]
    d = model.get("head_dim") or h // heads
    per_layer = 2 * h + h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * ffn  # norms, q, k+v, o, MLP
    assert 2 * vocab * h + model["num_layers"] * per_layer + h == PUBLISHED_PARAMETERS[name]
