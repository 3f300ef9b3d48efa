"""The planner's formulas reduce to the published ones they generalise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scaletrain.config_loader import load_config
from scaletrain.planner.activations import ActivationSettings, block_activations, stage_activations
from scaletrain.planner.flops import hardware_flops_per_token, logits_flops_per_token
from scaletrain.planner.layouts import Candidate
from scaletrain.planner.memory import MIXED_BF16, peak_memory, stage_memory, zero_partition_numel
from scaletrain.planner.params import stage_parameters
from scaletrain.planner.step_time import Hardware, predict_step_time

REPO = Path(__file__).resolve().parents[2]
KORTHIKANTI = ActivationSettings(activation_bytes=2, dropout_mask_bytes=1, attention="math")


@pytest.fixture(scope="module")
def gpt3_175b():
    config = load_config(REPO / "configs" / "gpt3_175b.yaml")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.1))


@pytest.mark.parametrize("tensor_parallel", [1, 2, 8])
def test_block_activations_are_korthikanti_eq_2(gpt3_175b, tensor_parallel):
    """s*b*h*(10 + 24/t + 5as/(ht)) bytes, the paper's 16-bit count, LayerNorm statistics aside."""
    model, t = gpt3_175b.model, tensor_parallel
    s, b, h, a = model.seq_length, 2, model.hidden_size, model.num_heads
    block = block_activations(model, b, t, KORTHIKANTI)
    paper = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert block.replicated + block.split + block.attention == pytest.approx(paper, rel=1e-12)


def test_sequence_parallel_divides_everything_by_t(gpt3_175b):
    model, t = gpt3_175b.model, 8
    s, b, h, a = model.seq_length, 1, model.hidden_size, model.num_heads
    block = block_activations(model, b, t, dataclasses.replace(KORTHIKANTI, sequence_parallel=True))
    assert block.replicated + block.split + block.attention == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)


def test_flash_drops_the_quadratic_term_and_recomputation_keeps_2sbh(gpt3_175b):
    model = gpt3_175b.model
    s, h = model.seq_length, model.hidden_size
    flash = block_activations(model, 1, 8, dataclasses.replace(KORTHIKANTI, attention="flash"))
    assert flash.attention == 4 * model.num_heads / 8 * s  # fp32 logsumexp per head and row
    middle = stage_activations(model, 50304, 1, 8, 6, first_stage=False, last_stage=False, recompute=True,
                               settings=KORTHIKANTI)
    assert middle.stored == 6 * 2 * s * h
    assert middle.recompute_working_set == block_activations(model, 1, 8, KORTHIKANTI).total


def test_recomputation_flops_are_megatron_96blsh2(gpt3_175b):
    """Narayanan et al. 2021: 96*B*s*l*h^2*(1 + s/6h + V/16lh) per step, i.e. per token below."""
    model, vocab = gpt3_175b.model, gpt3_175b.padded_vocab_size
    layers, h, s = model.num_layers, model.hidden_size, model.seq_length
    megatron = 96 * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))
    assert hardware_flops_per_token(gpt3_175b, recompute=True) == pytest.approx(megatron, rel=1e-12)
    assert logits_flops_per_token(gpt3_175b) == pytest.approx(6 * h * vocab)


def test_pipeline_bubble_is_p_minus_1_over_m(gpt3_175b):
    micro_batches = 64 // (2 * 4)
    layout = Candidate(tensor=8, pipeline=4, data=4, zero_stage=1, micro_batch=2, grad_accum=micro_batches,
                       recompute=True)
    time = predict_step_time(gpt3_175b, layout, Hardware(989e12), 2, 2)
    busy = time.compute + time.tensor_parallel + time.pipeline_parallel
    assert time.bubble / busy == pytest.approx((4 - 1) / micro_batches)


def test_zero_stages_partition_what_the_paper_says(gpt3_175b):
    settings = ActivationSettings()
    by_stage = {
        zero: stage_memory(gpt3_175b, Candidate(tensor=8, data=16, zero_stage=zero, recompute=True), 0, 96,
                           MIXED_BF16, settings)
        for zero in range(4)
    }
    assert by_stage[1].optimizer == pytest.approx(by_stage[0].optimizer / 16, rel=1e-6)
    # ZeRO-0 is FlatAdamW, which accumulates gradients in fp32; ZeRO-1/2 keep DeepSpeed's bf16 ones
    assert by_stage[0].gradients == 2 * by_stage[1].gradients
    assert by_stage[2].gradients == pytest.approx(by_stage[1].gradients / 16, rel=1e-6)
    assert by_stage[2].weights == by_stage[1].weights
    assert by_stage[3].weights < by_stage[2].weights / 8  # partitioned, plus two gathered blocks


def test_pipeline_without_zero_uses_deepspeeds_bf16_optimizer(gpt3_175b):
    """Master weights and moments partitioned as in ZeRO-1, plus full fp32 gradients."""
    zero0, zero1 = (
        stage_memory(gpt3_175b, Candidate(tensor=8, pipeline=16, data=8, zero_stage=zero, recompute=True), 0, 192,
                     MIXED_BF16, ActivationSettings())
        for zero in (0, 1)
    )
    params = stage_parameters(gpt3_175b, 8, 16, 0).total
    assert zero0.optimizer == zero1.optimizer
    assert zero0.gradients == zero1.gradients + 4 * params


def test_deepspeed_pads_each_group_to_2_dp_elements():
    assert zero_partition_numel(750, 2) == 376
    assert zero_partition_numel(50000, 2) == 25000
    assert zero_partition_numel(7, 4) == 2


def test_first_stage_holds_p_micro_batches_in_flight(gpt3_175b):
    """1F1B: stage 0 keeps min(p, m) micro-batches' activations and sent outputs (Narayanan et al. 2021)."""
    model, settings = gpt3_175b.model, ActivationSettings()
    layout = Candidate(tensor=8, pipeline=16, data=8, zero_stage=1, micro_batch=1, recompute=True)
    stored = stage_activations(model, gpt3_175b.padded_vocab_size, 1, 8, 6, first_stage=True, last_stage=False,
                               recompute=True, settings=settings).stored
    sent = model.seq_length * model.hidden_size * 2
    stage, memory = peak_memory(gpt3_175b, layout, 192, MIXED_BF16, settings)
    assert stage == 0
    assert memory.pipeline_buffers == pytest.approx(15 * stored + 16 * sent)
    few = stage_memory(gpt3_175b, layout, 0, 3, MIXED_BF16, settings)
    assert few.pipeline_buffers == pytest.approx(2 * stored + 3 * sent)


def test_an_explicit_attention_mask_adds_its_additive_copy_per_block(gpt3_175b):
    """Document masking keeps [b, s, s] per block in a fused kernel, a narrow window [s, s], a window as
    long as the sequence nothing (SDPA's is_causal then), and the math kernel nothing at all."""
    flash = dataclasses.replace(KORTHIKANTI, attention="flash")
    model, seq = gpt3_175b.model, gpt3_175b.model.seq_length

    def extra(settings: ActivationSettings = flash, **changes) -> float:
        masked = block_activations(dataclasses.replace(model, **changes), 2, 8, settings).total
        return masked - block_activations(model, 2, 8, settings).total

    assert extra(document_masking=True) == 2 * seq * seq * 2
    assert extra(sliding_window=seq // 2) == seq * seq * 2
    assert extra(sliding_window=seq) == 0
    assert extra(KORTHIKANTI, document_masking=True) == 0


@pytest.mark.parametrize(("backend", "dropout", "context", "flex"), [
    ("sdpa", 0.0, 1, False), ("flex", 0.0, 1, True), ("auto", 0.0, 1, True),
    ("auto", 0.1, 1, False),  # attention dropout: SDPA (model/decoder.py attention_backend)
    ("auto", 0.0, 2, False),  # context parallelism: SDPA's ring attention
])
def test_flex_attention_keeps_no_dense_mask_where_it_runs(gpt3_175b, backend, dropout, context, flex):
    """A layout planned with FlexAttention's block mask holds none of SDPA's additive [b, s, s] per block, and its
    kernel skips the masked tiles as a causal one does; where auto resolves to SDPA both stay."""
    from scaletrain.planner.step_work import causal_kernel

    def documents(**changes) -> object:
        return dataclasses.replace(gpt3_175b, model=dataclasses.replace(
            gpt3_175b.model, document_masking=True, dropout=dropout, **changes))

    layout = Candidate(tensor=8, pipeline=16, data=8, zero_stage=1, micro_batch=2, recompute=False, context=context)
    chosen, plain = (stage_memory(documents(attention_backend=name), layout, 0, 16, MIXED_BF16, ActivationSettings())
                     for name in (backend, "sdpa"))
    seq, blocks = gpt3_175b.model.seq_length, gpt3_175b.model.num_layers // 16
    mask = 2 * seq * seq * 2 * blocks  # one micro-batch's [b, s, s] bf16 per block (the in-flight ones apart)
    assert plain.activations - chosen.activations == (mask if flex else 0)
    assert causal_kernel(documents(attention_backend=backend), context) == flex
