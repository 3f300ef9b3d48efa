"""`scaletrain export` / `import` as a user runs them: TP=2 and PP=2 runs -> transformers.

The exported model's logits must equal the run's own (consolidated) model's on the same inputs,
and a run started from the imported weights must begin at the source run's validation loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from tests.distributed.harness import run_on_ranks
from tests.train.runs import REPO, TrainedAhead, read_metrics, run_scaletrain, tiny_overrides

FAMILIES = {
    "gpt": ("gpt_tiny.yaml", transformers.GPT2LMHeadModel),
    "bert": ("bert_tiny.yaml", transformers.BertForMaskedLM),
    "t5": ("t5_tiny.yaml", transformers.T5ForConditionalGeneration),
    "llama": ("llama_tiny.yaml", transformers.LlamaForCausalLM),
}
FAMILY_OVERRIDES = {"t5": ["model.num_decoder_layers=2"], "llama": ["model.num_kv_heads=2"]}


def _train(family: str, data_dir: Path, run_dir: Path, extra: list[str], nproc: int) -> None:
    overrides = [
        *tiny_overrides(data_dir, run_dir), *FAMILY_OVERRIDES.get(family, []), "model.ffn_hidden_size=128",
        "train.steps=6", "train.eval_every=6", *extra,
    ]
    run_scaletrain("train", [str(REPO / "configs" / FAMILIES[family][0]), *overrides], nproc)


def _our_logits(rank: int, world_size: int, run_dir: Path, inputs: dict) -> torch.Tensor:
    from megatron.core import parallel_state

    from scaletrain.checkpoint.format import latest_checkpoint
    from scaletrain.config_loader import load_config
    from scaletrain.generate import load_model
    from scaletrain.run_config import single_process_config

    parallel_state.initialize_model_parallel()
    checkpoint = latest_checkpoint(run_dir)
    model = load_model(single_process_config(load_config(checkpoint / "config.yaml")), checkpoint)
    with torch.no_grad():
        return model(**inputs).detach()


def _inputs(family: str) -> tuple[dict, dict]:
    """(our forward kwargs, HF forward kwargs) for the same batch, with padding for BERT/T5."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(7, 1000, (2, 32), generator=generator)
    if family in ("gpt", "llama"):
        return {"tokens": tokens}, {"input_ids": tokens}
    mask = torch.ones_like(tokens)
    mask[1, 20:] = 0
    if family == "bert":
        ours = {"tokens": tokens, "token_types": torch.zeros_like(tokens), "padding_mask": mask}
        return ours, {"input_ids": tokens, "attention_mask": mask, "token_type_ids": torch.zeros_like(tokens)}
    decoder = torch.randint(7, 1000, (2, 12), generator=generator)
    decoder[:, 0] = 0
    ours = {"encoder_tokens": tokens, "decoder_tokens": decoder, "encoder_padding_mask": mask}
    return ours, {"input_ids": tokens, "attention_mask": mask, "decoder_input_ids": decoder}


LAYOUTS = [("gpt", "parallel.tensor=2"), ("bert", "parallel.tensor=2"), ("t5", "parallel.tensor=2"),
           ("llama", "parallel.tensor=2"), ("gpt", "parallel.pipeline=2"), ("bert", "parallel.pipeline=2"),
           ("t5", "parallel.pipeline=2")]


@pytest.fixture(scope="module")
def parallel_runs(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedAhead]:
    """parallel_runs(family, layout): the run directory of each LAYOUTS case's 2-rank run; the next case's
    trains while a test checks its export."""

    def train(key: tuple[str, str], run_dir: Path) -> Path:
        family, layout = key
        _train(family, small_dataset, run_dir, [layout], nproc=2)
        return run_dir

    runs = TrainedAhead(train, lambda key: tmp_path_factory.mktemp("-".join(key)) / "run", LAYOUTS)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", LAYOUTS)
def test_export_of_a_parallel_run_matches_transformers(family, layout, small_dataset, parallel_runs, tmp_path):
    run_dir, hf_dir = parallel_runs(family, layout), tmp_path / "hf"
    run_scaletrain("export", [str(run_dir), str(hf_dir)])
    ours_inputs, hf_inputs = _inputs(family)
    ours = run_on_ranks(_our_logits, 1, run_dir, ours_inputs)[0]
    hf_model = FAMILIES[family][1].from_pretrained(hf_dir).eval()
    with torch.no_grad():
        theirs = hf_model(**hf_inputs).logits
    if family == "bert":  # padded positions are free to differ
        keep = hf_inputs["attention_mask"].bool()
        ours, theirs = ours[keep], theirs[keep]
    assert (ours - theirs).abs().max().item() <= 1e-4

    weights = tmp_path / "imported.pt"
    run_scaletrain("import", [str(hf_dir), str(weights), "--family", family])
    fresh = tmp_path / "fresh"
    start_from_import = [f"train.init_from={weights}", "train.steps=1", "train.warmup_steps=0", "train.eval_every=1"]
    _train(family, small_dataset, fresh, start_from_import, nproc=1)
    _, source_val = read_metrics(run_dir)
    _, fresh_val = read_metrics(fresh)
    assert abs(fresh_val[0] - source_val[6]) <= 1e-4
