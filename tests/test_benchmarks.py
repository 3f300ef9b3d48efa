"""The benchmarks run (their figures are measured by hand or on a GPU; here only that they work), each as
`python benchmarks/NAME.py ARGS` in a warm fork (tests/warm.py), which has imported torch, DeepSpeed and
megatron-core already."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from scaletrain.train.jit_ops import pin_build_root
from tests.train.runs import REPO, WARM_CLIENT, scaletrain_environment
from tests.warm import SCRIPT


def benchmark_environment() -> dict[str, str]:
    """scaletrain_environment() with DeepSpeed's CPU comm op built in this environment's own root, with its
    ninja, as a training run pins them (scaletrain/train/jit_ops.py; `make install` built it there): a
    benchmark builds its engine without the training loop, so it used torch's shared default root, which is
    rebuilt (~20-80 s) whenever another environment or ninja built it last. Pinned in the benchmark's
    environment only, not in this process."""
    with mock.patch.dict(os.environ):
        pin_build_root()
        return scaletrain_environment()


def run_benchmark(script: str, *args: str, environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT ARGS` from the repository, in a warm fork: the script runs as __main__."""
    return subprocess.run([sys.executable, str(WARM_CLIENT), SCRIPT, f"benchmarks/{script}", *args], cwd=REPO,
                          env=environment or benchmark_environment(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_gpt_throughput_times_scaletrain_and_the_plain_reference(small_dataset: Path):
    result = run_benchmark(
        "gpt_throughput.py", "configs/gpt_tiny.yaml", f"data.dir={small_dataset}", "data.vocab_size=1024",
        "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=32",
        "train.micro_batch_size=4", "train.global_batch_size=8", "--steps", "2", "--warmup", "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"scaletrain: +[\d.]+ ms/step", result.stdout), result.stdout
    assert re.search(r"step time ratio scaletrain / plain PyTorch: [\d.]+", result.stdout), result.stdout


@pytest.mark.slow
def test_document_masking_times_causal_documents_and_a_window():
    result = run_benchmark(
        "document_masking.py", "configs/llama_tiny.yaml", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=176", "model.seq_length=64", "train.micro_batch_size=2", "--mean-document", "16",
        "--window", "8", "--steps", "1", "--pairs", "3", "--warmup", "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # each line names the attention that ran: on CPU SDPA, is_causal where there is no mask
    for name in (r"causal \(sdpa is_causal\)", r"document masking \(sdpa\)", r"sliding window 8 \(sdpa\)"):
        assert re.search(rf"{name}: +[\d.]+ ms/step \(median\), +\d+ tokens/s", result.stdout), result.stdout


@pytest.mark.slow
def test_checkpoint_save_reports_stall_write_and_size_with_and_without_async(small_dataset: Path):
    for async_save in ("true", "false"):
        result = run_benchmark(
            "checkpoint_save.py", "configs/gpt_tiny.yaml", f"data.dir={small_dataset}", "data.vocab_size=1024",
            "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=32",
            "train.micro_batch_size=4", "train.global_batch_size=8", f"checkpoint.async_save={async_save}",
            "--saves", "2", "--every", "2",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        mode = "async" if async_save == "true" else "synchronous"
        assert re.search(rf"{mode} save: step \d+ ms; per save: call \d+ ms, stall -?\d+ ms, write \d+ ms, "
                         r"size [\d.]+ MiB", result.stdout), result.stdout


def test_generation_speed_times_both_decoders():
    result = run_benchmark("generation_speed.py", "--tokens", "4", "--seq-length", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    for family in ("llama", "gpt"):
        assert re.search(rf"{family} .* KV cache [\d.]+ tokens/s, recomputation [\d.]+ tokens/s, speedup [\d.]+x",
                         result.stdout), result.stdout


def test_loader_throughput_reports_every_configuration():
    result = run_benchmark(
        "loader_throughput.py", "--tokens", "200000", "--tokens-per-shard", "50000", "--seq-length", "128",
        "--micro-batch", "2", "--batches", "3", "--workers", "1", "2",
        environment={**benchmark_environment(), "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for label, workers in itertools.product(("local", "http warm", "http cold"), (1, 2)):
        assert re.search(rf"{label} +workers={workers}: +[\d.]+ samples/s, +[\d,]+ tokens/s; headroom per node "
                         r"\(8 loaders\) +[\d.]+x", result.stdout), result.stdout
def test_tokenize_throughput_times_the_plain_loop_and_prepare(small_dataset_raw: list[Path]):
    works = [str(path) for path in small_dataset_raw if path.name.startswith(("phoenix", "sonnets"))]
    result = run_benchmark("tokenize_throughput.py", *works, "--vocab-size", "400", "--num-sentinels", "8",
                           "--repeats", "1", "--end-to-end")
    assert result.returncode == 0, result.stderr[-3000:]
    rate = r"[\d,]+ tokens/s, [\d.]+ MB/s"
    assert re.search(rf"plain sentencepiece encode loop: {rate}", result.stdout), result.stdout
    for workers in (1, 2):
        assert re.search(rf"prepare tokenization, {workers} worker\(s\): {rate} .*; [\d.]+x the plain loop",
                         result.stdout), result.stdout
        assert re.search(rf"prepare end to end, {workers} worker\(s\): {rate}", result.stdout), result.stdout


@pytest.mark.slow
@pytest.mark.serial  # two namespace hosts, and a measurement: the machine to itself
def test_cross_host_measures_all_reduce_on_one_and_on_two_hosts():
    """Only the all-reduce part (the DP2 step needs a prepared demo dataset and ~1 minute); root only."""
    from tests.hosts import missing_requirement

    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)
    result = run_benchmark("cross_host.py", "--sizes-mb", "1", "--iterations", "2")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    rows = re.findall(r"^(one host|two hosts) +all-reduce 1 MB +[\d.]+ ms +([\d.]+) GB/s$", result.stdout,
                      flags=re.MULTILINE)
    assert [placement for placement, _ in rows] == ["one host", "two hosts"], result.stdout
    assert all(float(bandwidth) > 0 for _, bandwidth in rows)
