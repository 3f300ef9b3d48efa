"""A Mixtral-style run (configs/mixtral_tiny.yaml, tiny shapes, TP2) to and from transformers'
`MixtralForCausalLM` as a user does it: `scaletrain export` computes the run's logits, greedy decoding
of the export says what `scaletrain generate` says, `scaletrain import` inverts the export and a run
started from it begins at the source run's validation loss; what Mixtral cannot hold is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, MixtralForCausalLM

from scaletrain.config_loader import load_config
from scaletrain.families.llama.hf import export_hf
from tests.checkpoint.test_export_cli import _our_logits
from tests.distributed.harness import run_on_ranks
from tests.train.runs import REPO, read_metrics, run_scaletrain, tiny_overrides

CONFIG = str(REPO / "configs" / "mixtral_tiny.yaml")
TINY = ["model.moe.num_experts=4", "model.moe.ffn_hidden_size=32", "train.eval_every=20"]
STEPS = 20
NEW_TOKENS = 12


def _train(data_dir: Path, run_dir: Path, extra: list[str], nproc: int) -> None:
    run_scaletrain("train", [CONFIG, *tiny_overrides(data_dir, run_dir), *TINY, *extra], nproc)


@pytest.fixture(scope="module")
def exported(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixtral")
    run_dir, hf_dir = root / "run", root / "hf"
    _train(small_dataset, run_dir, [f"train.steps={STEPS}", "parallel.expert=2"], nproc=2)  # 2 experts per rank
    run_scaletrain("export", [str(run_dir), str(hf_dir)])
    return run_dir, hf_dir


@pytest.mark.slow
def test_export_computes_the_runs_logits(exported: tuple[Path, Path]):
    run_dir, hf_dir = exported
    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    tokens = torch.randint(7, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = run_on_ranks(_our_logits, 1, run_dir, {"tokens": tokens})[0]
    with torch.no_grad():
        theirs = MixtralForCausalLM.from_pretrained(hf_dir).eval()(input_ids=tokens).logits
    assert ours.std() > 0.1
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_scaletrain_generate_says_what_the_export_decodes(small_dataset: Path, tmp_path: Path):
    """A run of one step at a tiny learning rate is near its random init, whose greedy tokens vary (the
    trained tiny runs above only repeat their commonest token), so a wrong expert or weight would show."""
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    _train(small_dataset, run_dir, ["train.steps=1", "train.lr=1e-5", "train.min_lr=1e-6", "train.warmup_steps=0"],
           nproc=1)
    run_scaletrain("export", [str(run_dir), str(hf_dir)])
    prompt = "Now is the winter of our discontent"
    stdout = run_scaletrain("generate", [str(run_dir), "--prompt", prompt, "--temperature", "0",
                                         "--max-new-tokens", str(NEW_TOKENS)], timeout=300)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    model = MixtralForCausalLM.from_pretrained(hf_dir).eval()
    generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               num_beams=1)
    new = generated[0, inputs.input_ids.shape[1]:]
    assert len(set(new.tolist())) > 3
    assert stdout == prompt + tokenizer.decode(new, skip_special_tokens=True) + "\n"


@pytest.mark.slow
def test_import_inverts_the_export_and_trains_on(exported: tuple[Path, Path], small_dataset: Path,
                                                 tmp_path: Path):
    run_dir, hf_dir = exported
    weights = tmp_path / "imported.pt"
    run_scaletrain("import", [str(hf_dir), str(weights), "--family", "llama"])
    imported = torch.load(weights, weights_only=True)
    assert "blocks.1.mlp.experts.3.proj.weight" in imported and "blocks.0.mlp.router.weight" in imported
    fresh = tmp_path / "fresh"
    _train(small_dataset, fresh, [f"train.init_from={weights}", "train.steps=1", "train.warmup_steps=0",
                                  "train.eval_every=1"], nproc=1)
    assert abs(read_metrics(fresh)[1][0] - read_metrics(run_dir)[1][STEPS]) <= 1e-4


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["model.moe.every=2"], "model.moe.every=2: transformers' MixtralForCausalLM has experts in every layer"),
    (["model.moe.top_k=1"], "model.moe.top_k=1: MixtralForCausalLM renormalises the top-k weights"),
])
def test_export_refuses_what_mixtral_cannot_hold(overrides: list[str], fragment: str, tmp_path: Path):
    config = load_config(CONFIG, [*TINY, *overrides])
    with pytest.raises(ValueError, match=fragment):
        export_hf({}, config.model, config.padded_vocab_size, tmp_path)
    assert not any(tmp_path.iterdir())


def test_published_mixtral_shape_counts_as_transformers_does():
    """mixtral_8x7b.yaml is mistralai/Mixtral-8x7B-v0.1: transformers' model of its config.json (built on
    the meta device) has our parameter count, 46.7B, and we count 12.9B of them active."""
    from transformers import MixtralConfig

    from scaletrain.families import model_counts

    config = load_config(REPO / "configs" / "mixtral_8x7b.yaml")
    hf_config = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                              num_experts_per_tok=2, tie_word_embeddings=False)
    with torch.device("meta"):
        hf_params = sum(p.numel() for p in MixtralForCausalLM(hf_config).parameters())
    counts = model_counts(config)
    assert counts.total_params == hf_params == 46_702_792_704
    assert round(counts.active_params / 1e9, 1) == 12.9


def test_other_model_types_are_refused_naming_the_key(tmp_path: Path):
    from scaletrain.families.llama.hf import import_hf

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    with pytest.raises(ValueError, match="model_type='qwen2_moe'"):
        import_hf(tmp_path)



def test_a_windowed_mixture_of_experts_exports_its_window():
    """Mixtral has Mistral's sliding window: a llama with experts and a window exports both."""
    from scaletrain.families.llama.hf import LlamaShape, _hf_config

    config = load_config(CONFIG, [*TINY, "model.sliding_window=16"])
    shape = LlamaShape.from_model_config(config.model, config.padded_vocab_size)
    hf_config = _hf_config(config.model, config.padded_vocab_size, shape)
    assert (hf_config.model_type, hf_config.sliding_window, hf_config.num_local_experts) == ("mixtral", 16, 4)
