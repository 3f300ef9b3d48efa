"""`generate` and `export` aimed at a checkpoint (--checkpoint, as `eval` takes it), `export --dtype`, and what an
export states about its context: max_position_embeddings, and a generation_config.json whose max_length is the
context, so a transformers text-generation pipeline left at its default length (256 new tokens without it) stops
there. Past the context, transformers (5.x) checks no max_new_tokens: it warns, naming the context, before GPT-2's
position table fails; `handle_long_generation="hole"` refuses such a call in one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.train.runs import DEMO_CONFIG, REPO, launcher, run_scaletrain, scaletrain_environment, tiny_overrides

SEQ_LENGTH = 32


@pytest.fixture(scope="module")
def run_dir(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT run with checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("export_options") / "run"
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.steps=6",
                             "train.eval_every=0", "checkpoint.every=3"])
    return run_dir


def _scaletrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher(1), *args], cwd=REPO, env=scaletrain_environment(), capture_output=True,
                          text=True, timeout=300)


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.mark.slow
def test_generate_and_export_read_the_checkpoint_asked_for(run_dir: Path, tmp_path: Path) -> None:
    for option, step in ((["--checkpoint", "3"], 3), (["--checkpoint", "step_00000006"], 6), ([], 6)):
        generated = _scaletrain("generate", str(run_dir), "--max-new-tokens", "4", *option)
        assert generated.returncode == 0, generated.stderr[-2000:]
        assert f"using checkpoint {_checkpoint(run_dir, step)} (step {step})" in generated.stderr

    exported = _scaletrain("export", str(run_dir), str(tmp_path / "hf3"), "--checkpoint", str(_checkpoint(run_dir, 3)))
    assert exported.returncode == 0 and "(step 3)" in exported.stderr, exported.stderr[-2000:]
    run_scaletrain("export", [str(run_dir), str(tmp_path / "hf6")])
    embedding = [load_file(tmp_path / name / "model.safetensors")["transformer.wte.weight"] for name in ("hf3", "hf6")]
    assert not torch.equal(*embedding)

    missing = _scaletrain("export", str(run_dir), str(tmp_path / "hf99"), "--checkpoint", "99")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "--checkpoint 99 is not a complete checkpoint" in missing.stderr
    assert "its complete checkpoints are at steps 3, 6" in missing.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dtype, torch_dtype, name", [("bf16", torch.bfloat16, "bfloat16"),
                                                      ("fp16", torch.float16, "float16")])
def test_export_dtype_writes_the_weights_in_it(run_dir: Path, tmp_path: Path, dtype: str, torch_dtype: torch.dtype,
                                               name: str) -> None:
    run_scaletrain("export", [str(run_dir), str(tmp_path / "fp32")])
    run_scaletrain("export", [str(run_dir), str(tmp_path / dtype), "--dtype", dtype])
    assert json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == name
    full, cast = (load_file(tmp_path / directory / "model.safetensors") for directory in ("fp32", dtype))
    assert full.keys() == cast.keys()
    assert all(torch.equal(cast[key], tensor.to(torch_dtype)) for key, tensor in full.items())
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / dtype)
    assert model.dtype == torch_dtype


@pytest.mark.slow
def test_the_export_states_its_context(run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    export = tmp_path / "hf"
    run_scaletrain("export", [str(run_dir), str(export)])
    assert transformers.AutoConfig.from_pretrained(export).max_position_embeddings == SEQ_LENGTH
    generation = json.loads((export / "generation_config.json").read_text())
    assert {key: generation[key] for key in ("max_length", "bos_token_id", "eos_token_id", "pad_token_id")} == {
        "max_length": SEQ_LENGTH, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}

    pipeline = transformers.pipeline("text-generation", model=str(export))
    text = pipeline("KING:", do_sample=False)[0]["generated_text"]
    assert len(pipeline.tokenizer(text)["input_ids"]) <= SEQ_LENGTH  # eos + the prompt + what fits
    with pytest.raises(ValueError, match="the number of desired tokens exceeds the models max length"):
        pipeline("KING:", max_new_tokens=SEQ_LENGTH + 8, handle_long_generation="hole")
    with pytest.raises(IndexError):  # transformers' own failure, after it says why
        pipeline("KING:", max_new_tokens=SEQ_LENGTH + 8, do_sample=False)
    assert f"exceeded the model's predefined maximum length ({SEQ_LENGTH})" in caplog.text
