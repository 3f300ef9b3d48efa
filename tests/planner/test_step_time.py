"""The per-GEMM step-time model: its work adds up to the family's FLOPs, its GEMM table interpolates sensibly,
and `plan` reproduces the measured steps (measured_steps.json): step time and peak memory within 15%."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scaletrain.config_loader import load_config
from scaletrain.planner.flops import model_flops_per_token
from scaletrain.planner.kernel_time import DEVICES, KernelTimes, read_table, write_table
from scaletrain.planner.layouts import Candidate
from scaletrain.planner.measured_steps import (
    RECOMPUTE,
    MeasuredStep,
    append_measured_step,
    has_measured_step,
    measured_steps,
)
from scaletrain.planner.params import num_blocks
from scaletrain.planner.search import plan
from scaletrain.planner.step_time import Hardware, micro_batch_compute_seconds
from scaletrain.planner.step_work import (
    attention_shapes_for,
    block_work,
    blocks_flops_scale,
    gemm_shapes_for,
    mlp_gates,
    output_layer_gemm,
)

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
TOLERANCE = 0.15
H200 = Hardware(DEVICES["h200"].peak_flops, DEVICES["h200"].memory_bandwidth, device="h200")


def _config(name: str):
    return load_config(REPO / "configs" / name)


@pytest.mark.parametrize("name, tensor, gates", [
    ("gpt3_350m.yaml", 1, 1), ("gpt3_1.3b.yaml", 4, 1), ("llama3_8b.yaml", 1, 2), ("llama3_8b.yaml", 8, 2),
    ("mixtral_8x7b.yaml", 1, 2), ("llama_tiny.yaml", 1, 2), ("gpt_tiny.yaml", 2, 1),
])
def test_gemm_and_attention_flops_sum_to_the_family_count(name, tensor, gates):
    """Forward GEMMs + attention of every block + the output layer, x3 for backward, per token, times TP ranks:
    flops.py's model FLOPs (GQA's query and key_value GEMMs, SwiGLU's [gate; up], MoE's router and experts)."""
    config = _config(name)
    seq = config.model.seq_length
    forward = sum(block_work(config, layer, 1, tensor).flops for layer in range(num_blocks(config)))
    forward += output_layer_gemm(config, 1, tensor).flops
    assert 3 * forward * tensor / seq == pytest.approx(model_flops_per_token(config), rel=1e-12)
    assert mlp_gates(config) == gates and blocks_flops_scale(config) == pytest.approx(1.0, rel=1e-12)
    for gemm in block_work(config, 0, 2, tensor).gemms:
        assert sum(gradient.flops for gradient in gemm.backward()) == 2 * gemm.flops


def test_block_shapes_are_the_layers_gemms():
    """GPT-3 350M at micro-batch 8: [16384, 1024] x [1024, 3072] QKV, ...; llama 3 8B at TP 8: GQA's query and
    its 8 kv heads split over 8 ranks, SwiGLU's fused [gate; up]."""
    gpt = block_work(_config("gpt3_350m.yaml"), 0, 8, 1)
    assert [(g.name, g.m, g.n, g.k) for g in gpt.gemms] == [
        ("qkv", 16384, 3072, 1024), ("attention output", 16384, 1024, 1024), ("fc", 16384, 4096, 1024),
        ("proj", 16384, 1024, 4096)]
    assert gpt.attention.causal and gpt.attention.executed_forward_flops == gpt.attention.flops / 2
    llama = block_work(_config("llama3_8b.yaml"), 0, 1, 8)
    assert [(g.name, g.n, g.k) for g in llama.gemms] == [
        ("query", 512, 4096), ("key_value", 256, 4096), ("attention output", 4096, 512), ("fc", 3584, 4096),
        ("proj", 4096, 1792)]
    shapes = gemm_shapes_for([_config("gpt3_350m.yaml")], micro_batches=(1, 8))
    assert (16384, 3072, 1024) in shapes and (16384, 1024, 3072) in shapes and (1024, 3072, 16384) in shapes
    assert (2048, 50304, 1024) in shapes  # the output layer at micro-batch 1
    assert len(attention_shapes_for([_config("gpt3_350m.yaml")], micro_batches=(1, 8))) == 2


def _synthetic_table() -> KernelTimes:
    """A table that rises with size, as measured GEMMs do: the roofline fallback at a lower bandwidth."""
    slower = KernelTimes(989e12, 1e12)
    pairs = [(1024, 1024), (3072, 1024), (4096, 1024), (1024, 4096), (2048, 2048), (8192, 2048), (2048, 8192)]
    rows = tuple((m, n, k, slower.roofline_gemm_rate(m, n, k))
                 for m in (1024, 2048, 4096, 8192, 16384, 32768) for n, k in pairs)
    return KernelTimes(989e12, 4.8e12, rows)


def test_measured_points_are_exact_and_bigger_gemms_no_slower():
    table = _synthetic_table()
    for m, n, k, rate in table.gemm_rows:
        assert table.measured_gemm_rate(m, n, k) == pytest.approx(rate, rel=1e-12)
    for n, k in [(1024, 1024), (3072, 1024), (1536, 1536), (6144, 2048), (2048, 4096)]:
        rates = [table.measured_gemm_rate(m, n, k) for m in (1024, 1500, 2048, 3000, 16384, 20000, 65536)]
        assert all(rate is not None for rate in rates)
        assert rates == sorted(rates), (n, k)  # more tokens: no less efficient
    for m, n, k in [(1024, 1024, 1024), (2048, 1536, 1024), (4096, 3072, 1024)]:  # same aspect, twice the size
        assert table.measured_gemm_rate(2 * m, 2 * n, 2 * k) >= table.measured_gemm_rate(m, n, k)
    assert table.measured_gemm_rate(512, 1024, 1024) is None  # fewer tokens than measured
    assert table.measured_gemm_rate(8192, 50304, 1024) is None  # an (n, k) far from any measured
    fallback = KernelTimes(989e12, 4.8e12)
    sizes = [fallback.roofline_gemm_rate(2**e, 3 * 2**e, 2**e) for e in range(6, 16)]
    assert sizes == sorted(sizes) and sizes[-1] < 989e12


def test_table_file_round_trips(tmp_path):
    rows = [{"m": m, "n": n, "k": k, "tflops": rate / 1e12} for m, n, k, rate in _synthetic_table().gemm_rows]
    rows.append({"kind": "attention", "batch": 8, "heads": 16, "queries": 2048, "keys": 2048, "head_dim": 64,
                 "causal": True, "pass": "forward", "tflops": 300.0})
    path = write_table(rows, "test", tmp_path / "gemm_test.json")
    read = read_table(path, 989e12, 4.8e12)
    assert read.measured_gemm_rate(16384, 3072, 1024) == pytest.approx(
        _synthetic_table().measured_gemm_rate(16384, 3072, 1024), rel=1e-3)
    attention = block_work(_config("gpt3_350m.yaml"), 0, 8, 1).attention
    assert read.measured_attention_rate(attention, "forward") == 300e12
    assert read.measured_attention_rate(attention, "backward") is None
    assert len(path.read_text().splitlines()) == len(rows) + 9  # a row a line


def test_a_layout_is_measured_when_the_table_holds_every_gemm():
    config = _config("gpt3_350m.yaml")
    layout = Candidate(micro_batch=8)
    shapes = gemm_shapes_for([config], micro_batches=(8,))
    table = KernelTimes(989e12, 4.8e12, tuple((m, n, k, 600e12) for m, n, k in shapes))
    assert micro_batch_compute_seconds(config, layout, table, 2)[1]
    assert not micro_batch_compute_seconds(config, layout, KernelTimes(989e12, 4.8e12), 2)[1]
    assert has_measured_step(config, "h200") and not has_measured_step(config, "h100")
    assert not has_measured_step(_config("gpt3_2.7b.yaml"), "h200")


def _planned(step: MeasuredStep):
    """plan's row for the measured layout: one GPU, ZeRO-0 (what one rank runs), its micro-batch and recompute."""
    config = step.load_config()
    device = DEVICES[step.device]
    hardware = Hardware(device.peak_flops, device.memory_bandwidth, device=step.device)
    result = plan(config, gpus=1, gpu_memory=141 * GIB, hardware=hardware, max_micro_batch=step.micro_batch)
    layout = Candidate(micro_batch=step.micro_batch, grad_accum=step.grad_accum, recompute=RECOMPUTE[step.recompute])
    return next(planned for planned in result.layouts if planned.layout == layout)


def _row_id(step: MeasuredStep) -> str:
    return (f"{step.device}-{step.trainer}-{step.config}-mb{step.micro_batch}-ga{step.grad_accum}-{step.recompute}"
            f"-{step.optimizer}")


@pytest.mark.parametrize("step", measured_steps(), ids=_row_id)
def test_plan_reproduces_each_measured_step_time(step):
    if not step.current:
        pytest.skip(f"measured with {step.optimizer}, before the optimizer fix the model assumes")
    if step.recompute not in RECOMPUTE:
        pytest.skip(f"recompute={step.recompute!r} is not a layout plan offers")
    predicted = _planned(step).step_time.total * 1e3
    assert predicted == pytest.approx(step.step_ms, rel=TOLERANCE), f"predicted {predicted:.1f} ms"


@pytest.mark.parametrize("step", [step for step in measured_steps() if step.peak_gib is not None], ids=_row_id)
def test_plan_reproduces_each_measured_peak_memory(step):
    """The planner models scaletrain's memory; the plain loop keeps fp32 weights and gradients under autocast."""
    if step.trainer != "scaletrain":
        pytest.skip(f"{step.trainer} keeps other model states than scaletrain")
    predicted = _planned(step).memory.total / GIB
    assert predicted == pytest.approx(step.peak_gib, rel=TOLERANCE), f"predicted {predicted:.2f} GiB"


@pytest.mark.parametrize("name", ["gpt3_350m.yaml", "gpt3_1.3b.yaml"])
def test_micro_batch_1_is_slower_per_token_than_8(name):
    """Same global batch, so the step times compare per token: a 2048-row GEMM reaches less of the peak."""
    config = load_config(REPO / "configs" / name, ["train.global_batch_size=64"])
    result = plan(config, gpus=1, gpu_memory=141 * GIB, hardware=H200)
    times = {planned.layout.micro_batch: planned.step_time.total for planned in result.layouts
             if planned.layout.zero_stage == 0 and not planned.layout.recompute}
    assert times[1] > 1.02 * times[8]
    # the H200's GEMM table covers these shapes and the model's whole step was measured there
    assert all(planned.calibrated for planned in result.layouts)


def test_a_model_without_a_measured_step_is_modelled_not_calibrated():
    config = load_config(REPO / "configs" / "gpt3_760m.yaml", ["train.global_batch_size=64"])
    result = plan(config, gpus=1, gpu_memory=141 * GIB, hardware=H200)
    assert not any(planned.calibrated for planned in result.layouts)


def test_appended_rows_keep_the_file_a_row_a_line(tmp_path):
    path = shutil.copy(Path(__file__).resolve().parents[2] / "scaletrain/planner/measured_steps.json", tmp_path)
    before = measured_steps(Path(path))
    row = MeasuredStep("h200", "gpt3_350m.yaml", "scaletrain", 8, 1, "none", 2048, 120.0, 21.0, "flat_adamw",
                       "2.11", "13.0", "2026-12-01")
    append_measured_step(row, Path(path))
    assert measured_steps(Path(path)) == [*before, row]
    assert len(Path(path).read_text().splitlines()) == len(before) + 6
    assert json.loads(Path(path).read_text())["description"]
    with pytest.raises(ValueError, match="recompute='some'"):
        append_measured_step(MeasuredStep(**{**row.__dict__, "recompute": "some"}), Path(path))
