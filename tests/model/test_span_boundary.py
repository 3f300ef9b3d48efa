"""SpanBERT's span boundary objective (Joshi et al. 2020, sec. 3.2): the head's maths against a direct
re-implementation of eq. 1, the pipeline's loss path against the single-device one, the HF export
(which drops the head) keeping MLM parity, and the errors for inputs that do not fit the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from transformers import BertForMaskedLM

from scaletrain.batch import IGNORE_INDEX
from scaletrain.config import Config, ConfigError
from scaletrain.config_loader import load_config
from scaletrain.data.masking import SPAN_BOUNDARY_KEYS
from scaletrain.families import build_model
from scaletrain.families.bert import hf as hf_bert
from scaletrain.model.encoder import labelled_positions, mlm_loss
from scaletrain.train.objective import build_objective
from scaletrain.train.step import model_inputs
from tests.distributed.harness import gather_full_parameters, run_on_ranks
from tests.train.runs import REPO

BATCH = 4
SPAN_BOUNDARY = ["objective.span_masking=true", "objective.span_boundary=true"]


def tiny_config(data_dir: Path, *overrides: str) -> Config:
    return load_config(REPO / "configs" / "bert_tiny.yaml", [
        f"data.dir={data_dir}", "data.vocab_size=1024", "data.num_sentinels=16", "data.loader_workers=0",
        "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=40",
        f"train.micro_batch_size={BATCH}", *SPAN_BOUNDARY, *overrides,
    ])


def reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], eps: float) -> torch.Tensor:
    """MLM + SBO, each the mean over masked tokens, token by token from the parameters (eq. 1)."""
    weights = dict(model.named_parameters())
    inputs = (batch["tokens"], batch["token_types"], batch["padding_mask"])
    hidden = model.run_layers(inputs, until="")[0]  # [seq, batch, h], the encoder's output
    word = weights["embedding.word.weight"]

    def layer(x: torch.Tensor, name: str, norm: str) -> torch.Tensor:
        x = F.gelu(x @ weights[f"{name}.weight"].T + weights[f"{name}.bias"])
        return F.layer_norm(x, x.shape[-1:], weights[f"{norm}.weight"], weights[f"{norm}.bias"], eps)

    masked_lm, span_boundary = [], []
    for row, position in (batch["labels"] != IGNORE_INDEX).nonzero().tolist():
        target = batch["labels"][row, position]
        left, right = batch["left_boundary"][row, position], batch["right_boundary"][row, position]
        relative = weights["span_boundary_head.position_embedding.weight"][batch["span_position"][row, position] - 1]
        transformed = layer(hidden[position, row], "lm_head.dense", "lm_head.norm")
        masked_lm.append(F.cross_entropy(transformed @ word.T + weights["lm_head.bias"], target))
        h0 = torch.cat([hidden[left, row], hidden[right, row], relative])
        y = layer(layer(h0, "span_boundary_head.dense_in", "span_boundary_head.norm_in"),
                  "span_boundary_head.dense_out", "span_boundary_head.norm_out")
        span_boundary.append(F.cross_entropy(y @ word.T + weights["span_boundary_head.decoder_bias"], target))
    return torch.stack(masked_lm).mean() + torch.stack(span_boundary).mean()


def _measure(rank: int, world_size: int, data_dir: Path, export_dir: Path) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    results = {}
    for name, overrides in {"packed": [], "pairs_whole_words": ["objective.sentence_pairs=sop",
                                                                "objective.whole_word_masking=true"]}.items():
        config = tiny_config(data_dir, *overrides)
        model = build_model(config).eval()
        with torch.no_grad():  # no LayerNorm at 1 and 0, no bias at 0: a swapped parameter shows
            for index, parameter in enumerate(model.parameters()):
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(index)))
        batch = next(iter(build_objective(config).train_loader(0, 1, 0)))
        loss = model(**model_inputs(batch))
        inputs = tuple(batch[key] for key in ("tokens", "token_types", "padding_mask", *SPAN_BOUNDARY_KEYS))
        labels = (batch["labels"], *([batch["sentence_order_labels"]] if "sentence_order_labels" in batch else []))
        sentence_order = torch.zeros(()) if len(labels) == 1 else F.cross_entropy(
            model.sentence_order_logits(*inputs[:3]), labels[1])
        results[name] = {
            "loss": loss.item(), "reference": (reference_loss(model, batch, config.model.layernorm_eps)
                                               + sentence_order).item(),
            "pipeline_loss": mlm_loss(model.run_layers(inputs), labels).item(),
            "batch": batch, "max_position": labelled_positions(config),
        }
        if name == "packed":
            state = gather_full_parameters(model)
            hf_bert.export_hf(state, config.model, config.padded_vocab_size, export_dir)
            results[name]["logits"] = model(*inputs[:3]).detach()
            results[name]["accuracy"] = [c.item() for c in model.masked_token_accuracy(**batch)]
    return results


@pytest.fixture(scope="module")
def measured(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    export_dir = tmp_path_factory.mktemp("span_boundary_export") / "hf"
    return run_on_ranks(_measure, 1, small_dataset, export_dir)[0], export_dir


@pytest.mark.parametrize("name", ["packed", "pairs_whole_words"])
def test_loss_is_mlm_plus_span_boundary_of_equation_1(measured, name: str) -> None:
    result = measured[0][name]
    assert result["loss"] == pytest.approx(result["reference"], rel=1e-5)
    assert result["pipeline_loss"] == pytest.approx(result["loss"], rel=1e-5)
    assert int(result["batch"]["span_position"].max()) <= result["max_position"]


def test_export_drops_the_head_and_keeps_mlm_parity(measured) -> None:
    results, export_dir = measured
    batch = results["packed"]["batch"]
    hf_model = BertForMaskedLM.from_pretrained(export_dir).eval()
    with torch.no_grad():
        logits = hf_model(input_ids=batch["tokens"], token_type_ids=batch["token_types"],
                          attention_mask=batch["padding_mask"]).logits
    torch.testing.assert_close(logits, results["packed"]["logits"], rtol=1e-5, atol=1e-5)
    assert not any("span" in name for name in hf_model.state_dict())
    correct, labelled = results["packed"]["accuracy"]
    assert 0 <= correct <= labelled == int((batch["labels"] != IGNORE_INDEX).sum())


def _refusals(rank: int, world_size: int, data_dir: Path) -> list[str]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with_head = build_model(tiny_config(data_dir))
    without_head = build_model(tiny_config(data_dir, "objective.span_boundary=false"))
    batch = next(iter(build_objective(tiny_config(data_dir)).train_loader(0, 1, 0)))
    messages = []
    for model, inputs in ((with_head, {key: batch[key] for key in ("tokens", "labels")}),
                          (without_head, model_inputs(batch))):
        try:
            model(**inputs)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_inputs_that_do_not_fit_the_model_are_refused(small_dataset: Path) -> None:
    without_inputs, without_head = run_on_ranks(_refusals, 1, small_dataset)[0]
    assert "has the span boundary head" in without_inputs and "left_boundary" in without_inputs
    assert "objective.span_boundary=true" in without_head


def test_config_requires_span_masking_and_a_masked_lm(small_dataset: Path) -> None:
    with pytest.raises(ConfigError, match="objective.span_masking=true"):
        tiny_config(small_dataset, "objective.span_masking=false")
    # a family without the masked LM has no such keys (its objective section is another): the first of the
    # masked LM's keys the config sets is named, with the families that have it
    with pytest.raises(ConfigError, match=r"unknown key objective\.mask_prob \(model\.family=bert or albert or "):
        tiny_config(small_dataset, "model.family=gpt", "objective.kind=auto")
