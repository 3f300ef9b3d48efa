"""The GPU check in ten minutes (one H100 or H200): training-step throughput against a plain PyTorch loop,
peak memory, the GEMM and attention tables `scaletrain plan` calibrates on, and the GPU correctness tests.

    python benchmarks/gpu_check.py [--out DIR] [--quick]        (or: make bench-gpu)

It prints a line per measurement as it goes, so a run cut off at a time limit has still said what it
measured; what no GPU has measured yet comes first, in this order:
1. GPT-3 350M (bf16, seq 2048, micro-batch 8, one rank, grad_accum 1) through
   benchmarks/gpt_throughput.py: eager against a nanoGPT-style loop with torch's fused AdamW (alternating
   pairs; the baseline on this card), then scaletrain alone with train.compile, selective recompute and the
   chunked loss; then benchmarks/document_masking.py: causal SDPA against document masking and a window
   through FlexAttention in the training loop. Each case in its own process, so each peak memory is its own.
2. `pytest -m gpu` (tests/test_gpu.py): every family trains 20 bf16 steps with a falling loss, a
   checkpoint moves GPU -> CPU -> GPU, greedy decoding on the GPU equals the CPU's.
3. The planner's tables (planner/kernel_time.py), only for a card scaletrain/planner has no
   gemm_<device>.json for (or with --tables): bf16 GEMMs and SDPA attention of the GPT-3 and Llama shapes,
   written into --out.
4. 1.3B eager against the plain loop and compiled, full recompute at 350M and 1.3B, selective at 1.3B,
   and both at grad_accum 32.
On one H200 (2026-11-28) all of it took 545 s (the tests 2 minutes), without the tables (installed); the
tables took about a minute more on 2026-11-27.
Compare the measured peaks and step times with `scaletrain plan CONFIG --gpus 1 ...` on any machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (config, grad_accum, recompute, extra arguments): the first rows say the most. The eager step against the
# plain loop comes first as the baseline on this card; then what no GPU has run yet (train.compile, selective
# recompute, the chunked loss, FlexAttention in the training loop); a benchmark other than
# gpt_throughput.py is named by a "script=" item.
FIRST_CASES = [
    ("gpt3_350m", 1, "none", ["--steps", "5", "--pairs", "2"]),
    ("gpt3_350m", 1, "none", ["--steps", "5", "--pairs", "1", "--warmup", "3", "--scaletrain-only",
                              "train.compile=true"]),
    ("gpt3_350m", 1, "selective", ["--steps", "5", "--pairs", "1", "--scaletrain-only"]),
    ("gpt3_350m", 1, "none", ["--steps", "5", "--pairs", "1", "--scaletrain-only", "train.loss_chunk_size=4096"]),
    # causal SDPA against document masking and a window of 1024 through FlexAttention (attention_backend auto)
    ("gpt3_350m", 1, "none", ["script=document_masking.py", "--mean-document", "512", "--window", "1024",
                              "--steps", "3", "--pairs", "2"]),
]
# after the tests
LATER_CASES = [
    ("gpt3_1.3b", 1, "none", ["--steps", "3", "--pairs", "1"]),
    ("gpt3_1.3b", 1, "none", ["--steps", "3", "--pairs", "1", "--warmup", "3", "--scaletrain-only",
                              "train.compile=true"]),
    ("gpt3_350m", 1, "full", ["--steps", "5", "--pairs", "1", "--scaletrain-only"]),
    ("gpt3_1.3b", 1, "selective", ["--steps", "3", "--pairs", "1", "--scaletrain-only"]),
    ("gpt3_1.3b", 1, "full", ["--steps", "3", "--pairs", "1", "--scaletrain-only"]),
    ("gpt3_350m", 32, "none", ["--steps", "1", "--pairs", "1", "--warmup", "1"]),
    ("gpt3_1.3b", 32, "none", ["--steps", "1", "--pairs", "1", "--warmup", "1"]),
]
MICRO_BATCH = 8


def say(line: str) -> None:
    print(line, flush=True)


def recompute_overrides(recompute: str) -> list[str]:
    """train.activation_checkpoint=none|selective|full, or the interval alone where that key is not known."""
    import dataclasses

    from scaletrain.config import TrainConfig

    interval = f"train.activation_checkpoint_interval={int(recompute == 'full')}"
    if "activation_checkpoint" not in {field.name for field in dataclasses.fields(TrainConfig)}:
        return [interval]
    return [f"train.activation_checkpoint={recompute}", interval]


def throughput(config: str, grad_accum: int, recompute: str, extra: list[str], log: Path) -> None:
    """One case through gpt_throughput.py (or the "script=" item's benchmark); train.grad_accum follows from
    the global batch at launch."""
    script = next((item.split("=", 1)[1] for item in extra if item.startswith("script=")), "gpt_throughput.py")
    extra = [item for item in extra if not item.startswith("script=")]
    command = [sys.executable, str(REPO / "benchmarks" / script), str(REPO / "configs" / f"{config}.yaml"),
               f"train.micro_batch_size={MICRO_BATCH}",
               f"train.global_batch_size={MICRO_BATCH * grad_accum}", *recompute_overrides(recompute),
               *[item for item in extra if "=" in item],  # overrides before the options: argparse wants them together
               *[item for item in extra if "=" not in item]]
    named = f" ({script})" if script != "gpt_throughput.py" else ""
    say(f"== {config} micro-batch {MICRO_BATCH} x grad_accum {grad_accum}, recompute {recompute}"
        + "".join(f", {item}" for item in extra if "=" in item) + named)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with log.open("a") as file:
        file.write(f"$ {' '.join(command)}\n{result.stdout}\n{result.stderr}\n")
    lines = [line for line in result.stdout.splitlines()
             if any(key in line for key in ("ms/step", "peak memory", "ratio", "MFU =", "model:", "layers, hidden"))]
    for line in lines or [f"failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}"]:
        say(f"   {line.strip()}")
    say(f"   ({time.perf_counter() - started:.0f} s)")


def device_key() -> str:
    import torch

    name = torch.cuda.get_device_name().lower()
    return "h200" if "h200" in name else "h100" if "h100" in name else name.replace(" ", "_")


def planner_tables(out: Path) -> None:
    """GEMM and attention timings for `scaletrain plan` (planner/kernel_time.py)."""
    from scaletrain.config_loader import load_config
    from scaletrain.planner.kernel_time import measure_attention_table, measure_gemm_table, write_table
    from scaletrain.planner.step_work import attention_shapes_for, gemm_shapes_for

    device = device_key()
    configs = [load_config(REPO / "configs" / f"{config}.yaml", ["tracking.wandb=disabled"])
               for config in ("gpt3_125m", "gpt3_350m", "gpt3_760m", "gpt3_1.3b", "gpt3_2.7b", "llama3_8b")]
    started = time.perf_counter()
    rows = measure_gemm_table(gemm_shapes_for(configs))
    say(f"   {len(rows)} GEMM shapes in {time.perf_counter() - started:.0f} s; e.g. "
        + ", ".join(f"{r['m']}x{r['n']}x{r['k']}: {r['tflops']} TFLOP/s" for r in rows[::max(1, len(rows) // 4)]))
    attention = measure_attention_table(attention_shapes_for(configs))
    say(f"   {len(attention)} attention rows; e.g. " + ", ".join(
        f"b{r['batch']} h{r['heads']} s{r['queries']} {r['pass']}: {r['tflops']} TFLOP/s" for r in attention[:4]))
    path = write_table(rows + attention, device, out / f"gemm_{device}.json")
    say(f"   written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")),
                        help="where the log and the planner's tables go (default: $OUT or ./gpu_check)")
    parser.add_argument("--quick", action="store_true", help="only the first two throughput cases and the tests")
    parser.add_argument("--skip-tests", action="store_true", help="no pytest -m gpu")
    parser.add_argument("--tables", action="store_true",
                        help="measure the planner's tables even where scaletrain/planner has this card's")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False)")
    say(f"gpu_check {datetime.date.today()}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    log = args.out / "throughput.log"
    for config, grad_accum, recompute, extra in FIRST_CASES[:2] if args.quick else FIRST_CASES:
        throughput(config, grad_accum, recompute, extra, log)
    if not args.skip_tests:
        say("== pytest -m gpu")
        result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p",
                                 "no:cacheprovider"], cwd=REPO, capture_output=True, text=True)
        (args.out / "pytest_gpu.log").write_text(result.stdout + result.stderr)
        for line in result.stdout.splitlines()[-15:]:
            say(f"   {line}")
    if args.quick:
        return
    installed = REPO / "scaletrain" / "planner" / f"gemm_{device_key()}.json"
    if args.tables or not installed.exists():
        say("== planner tables (bf16 GEMMs, SDPA attention)")
        try:
            planner_tables(args.out)
        except Exception as error:  # the cases below still run
            say(f"   failed: {type(error).__name__}: {error}")
    for config, grad_accum, recompute, extra in LATER_CASES:
        throughput(config, grad_accum, recompute, extra, log)
    if not args.tables and installed.exists():
        say(f"== planner tables: {installed.relative_to(REPO)} is installed (--tables measures them again)")


if __name__ == "__main__":
    main()
