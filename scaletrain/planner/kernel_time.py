"""How long a GEMM, a flash-attention pass or a memory-bound pass takes on one GPU: measured, else a roofline.

GEMMs take 2mnk / rate(m, n, k). Where the device has a table of measured bf16 `torch.matmul` throughputs
(gemm_<device>.json beside this module, written on a GPU by `measure_gemm_table` + `write_table`), the rate
is interpolated from it in log space: along m (the tokens: micro-batch x seq) between the measured m of each
measured (n, k), held at the largest measured m above it, then weighted by inverse squared log2-distance over
the measured (n, k) within a factor 2 of the query in both; exact at a measured shape. A shape outside the
table (m below its smallest, or (n, k) further away), or a device without one, gets the roofline fallback
(Williams et al. 2009, "Roofline", CACM 52(4)): a GEMM is bound by its FLOPs at the peak and by its bytes,
2(mk + kn + mn) in bf16, at the HBM bandwidth. Taking the sum of the two times rather than their max gives
smaller GEMMs (micro-batch 1, large TP) a lower efficiency before the ridge point as measured GEMMs show,
instead of a kink there; the FLOPs side is capped at `GEMM_MAX_EFFICIENCY`.

Flash attention runs at a fraction of peak over the FLOPs it executes (step_work.py: half the square when
causal, 2.5x in backward): from the table's "attention" rows where measured (nearest measured
(keys, head_dim) within a factor 2), else `FLASH_EFFICIENCY`. Memory-bound passes (norms, activations,
residual and bias adds, the fp32 loss, the optimizer step) move their bytes at `STREAM_EFFICIENCY` of the
HBM bandwidth.

Table file: {"device", "gpu" (torch's name for it), "torch", "cuda", "date", "rows": [{"m", "n", "k",
"tflops"} for GEMMs, {"kind": "attention", "batch", "heads", "queries", "keys", "head_dim", "causal",
"pass": "forward" | "backward", "tflops"} for flash attention]}, tflops counting executed FLOPs.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from scaletrain.planner.step_work import Attention, Gemm

TABLE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Device:
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # HBM bytes/s


# NVIDIA datasheets: H100 SXM5 989.4 dense bf16 TFLOP/s, 3.35 TB/s HBM3; H200 the same compute, 4.8 TB/s HBM3e
DEVICES = {"h100": Device(989e12, 3.35e12), "h200": Device(989e12, 4.8e12)}

# The GEMM cap and the fraction of HBM bandwidth memory-bound kernels reach: calibrated on the plain PyTorch
# loop on an H200 (measured_steps.json, trainer "plain_pytorch": GPT-3 350M and 1.3B at micro-batch 8,
# within 3%), the best evidence of what the GEMMs cost until a table is measured.
GEMM_MAX_EFFICIENCY = 0.75
STREAM_EFFICIENCY = 0.8
# Roughly what FlashAttention-2 reaches on an H100, causal, seq 2k, head dim 64-128: ~300 TFLOP/s forward and
# ~250 backward of 989 (Shah et al. 2024, FlashAttention-3, figs. 5-6, its FA2 baseline)
FLASH_EFFICIENCY = {"forward": 0.30, "backward": 0.25}
NEIGHBOURHOOD = 1.0  # log2 distance in n and in k (a factor 2) within which a measured (n, k) is used


@dataclass(frozen=True)
class KernelTimes:
    """One device's kernel times: its measured table rows, if any, and the fallback's peak and bandwidth."""

    peak_flops: float
    memory_bandwidth: float
    gemm_rows: tuple[tuple[int, int, int, float], ...] = ()  # (m, n, k, FLOP/s)
    attention_rows: tuple[dict, ...] = ()

    def gemm_seconds(self, gemm: Gemm) -> float:
        rate = self.measured_gemm_rate(gemm.m, gemm.n, gemm.k) or self.roofline_gemm_rate(gemm.m, gemm.n, gemm.k)
        return gemm.flops / rate

    def roofline_gemm_rate(self, m: int, n: int, k: int) -> float:
        seconds = 2 * m * n * k / (GEMM_MAX_EFFICIENCY * self.peak_flops) + 2 * (m * k + k * n + m * n) / \
            self.memory_bandwidth
        return 2 * m * n * k / seconds

    def measured_gemm_rate(self, m: int, n: int, k: int) -> float | None:
        """FLOP/s interpolated from the table (module docstring); None outside it."""
        rates = []
        for (pair_n, pair_k), series in _series_by_pair(self.gemm_rows).items():
            distance = math.hypot(math.log2(n / pair_n), math.log2(k / pair_k))
            if abs(math.log2(n / pair_n)) > NEIGHBOURHOOD or abs(math.log2(k / pair_k)) > NEIGHBOURHOOD:
                continue
            log_rate = _along_m(series, m)
            if log_rate is None:
                continue
            if distance == 0:
                return math.exp(log_rate)
            rates.append((1 / distance**2, log_rate))
        if not rates:
            return None
        return math.exp(sum(weight * rate for weight, rate in rates) / sum(weight for weight, _ in rates))

    def attention_seconds(self, attention: Attention, direction: str) -> float:
        flops = attention.executed_forward_flops * (2.5 if direction == "backward" else 1.0)
        return flops / (self.measured_attention_rate(attention, direction)
                        or FLASH_EFFICIENCY[direction] * self.peak_flops)

    def measured_attention_rate(self, attention: Attention, direction: str) -> float | None:
        """The nearest measured row's rate, by keys, head_dim and batch x heads (the kernel's parallelism: one
        sequence of 16 heads runs at 40-60% of the rate of 8 sequences), within a factor 2 in keys and head_dim."""
        near = [(math.hypot(math.log2(attention.keys / row["keys"]), math.log2(attention.head_dim / row["head_dim"]),
                            math.log2(attention.batch * attention.heads / (row["batch"] * row["heads"]))),
                 row["tflops"] * 1e12) for row in self.attention_rows
                if row["pass"] == direction and row["causal"] == attention.causal
                and abs(math.log2(attention.keys / row["keys"])) <= NEIGHBOURHOOD
                and abs(math.log2(attention.head_dim / row["head_dim"])) <= NEIGHBOURHOOD]
        return min(near)[1] if near else None

    def memory_seconds(self, num_bytes: float) -> float:
        return num_bytes / (STREAM_EFFICIENCY * self.memory_bandwidth)


@functools.lru_cache(maxsize=8)
def _series_by_pair(rows: tuple[tuple[int, int, int, float], ...]) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """Per measured (n, k): (log m, log rate) sorted by m, repeated measurements averaged."""
    grouped: dict[tuple[int, int], dict[int, list[float]]] = {}
    for m, n, k, rate in rows:
        grouped.setdefault((n, k), {}).setdefault(m, []).append(math.log(rate))
    return {pair: [(math.log(m), sum(logs) / len(logs)) for m, logs in sorted(by_m.items())]
            for pair, by_m in grouped.items()}


def _along_m(series: list[tuple[float, float]], m: int) -> float | None:
    """Log rate at m, linear in log m between measured points, the largest one's above them; None below."""
    log_m = math.log(m)
    if log_m < series[0][0]:
        return None
    for (low_m, low_rate), (high_m, high_rate) in itertools.pairwise(series):
        if log_m <= high_m:
            return low_rate + (high_rate - low_rate) * (log_m - low_m) / (high_m - low_m)
    return series[-1][1]


def table_path(device: str) -> Path:
    return TABLE_DIR / f"gemm_{device}.json"


@functools.lru_cache(maxsize=8)
def kernel_times(peak_flops: float, memory_bandwidth: float, device: str | None) -> KernelTimes:
    """The device's measured table where gemm_<device>.json exists, else the fallback alone."""
    path = table_path(device) if device else None
    if path is None or not path.exists():
        return KernelTimes(peak_flops, memory_bandwidth)
    return read_table(path, peak_flops, memory_bandwidth)


def read_table(path: Path, peak_flops: float, memory_bandwidth: float) -> KernelTimes:
    rows = json.loads(path.read_text())["rows"]
    gemms = tuple((row["m"], row["n"], row["k"], row["tflops"] * 1e12) for row in rows
                  if row.get("kind", "gemm") == "gemm")
    attention = tuple(row for row in rows if row.get("kind") == "attention")
    return KernelTimes(peak_flops, memory_bandwidth, gemms, attention)


def measure_gemm_table(shapes: Iterable[tuple[int, int, int]], device: str = "cuda", warmup: int = 3,
                       repeats: int = 10) -> list[dict]:
    """Rows {m, n, k, tflops}: bf16 torch.matmul of [m, k] x [k, n] on `device`, the median of `repeats`
    CUDA-event timings after `warmup` calls. Shapes from step_work.gemm_shapes_for."""
    import torch  # here, not at the top: the planner runs without a GPU and `scaletrain --help` imports it

    rows = []
    for m, n, k in shapes:
        left = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        right = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds = _median_seconds(functools.partial(torch.matmul, left, right), warmup, repeats)
        rows.append({"m": m, "n": n, "k": k, "tflops": round(2 * m * n * k / seconds / 1e12, 2)})
        del left, right  # before the next shape's: an output layer's operands reach 33 GiB (llama 3 8B)
    return rows


def measure_attention_table(calls: Iterable[Attention], device: str = "cuda", warmup: int = 3,
                            repeats: int = 10) -> list[dict]:
    """Rows of kind "attention", forward and backward, of SDPA on bf16 [batch, heads, seq, head_dim] tensors,
    tflops over the FLOPs the kernel executes (step_work.Attention). Calls from step_work.attention_shapes_for."""
    import torch
    import torch.nn.functional as F

    rows = []
    for call in calls:
        shape = (call.batch, call.heads, call.queries, call.head_dim)
        inputs = [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        gradient = torch.randn(shape, device=device, dtype=torch.bfloat16)
        forward = functools.partial(F.scaled_dot_product_attention, *inputs, is_causal=call.causal)
        forward_seconds = _median_seconds(forward, warmup, repeats)
        backward_seconds = _median_seconds(lambda forward=forward, gradient=gradient: forward().backward(gradient),
                                           warmup, repeats) - forward_seconds
        for direction, seconds, times in (("forward", forward_seconds, 1.0), ("backward", backward_seconds, 2.5)):
            rows.append({"kind": "attention", "batch": call.batch, "heads": call.heads, "queries": call.queries,
                         "keys": call.keys, "head_dim": call.head_dim, "causal": call.causal, "pass": direction,
                         "tflops": round(call.executed_forward_flops * times / seconds / 1e12, 2)})
    return rows


def _median_seconds(run: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median time of one call on the GPU: CUDA events around each of `repeats` back-to-back calls."""
    import torch

    for _ in range(warmup):
        run()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    events[0].record()
    for event in events[1:]:
        run()
        event.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) / 1e3 for start, end in itertools.pairwise(events))
    return times[len(times) // 2]


def write_table(rows: list[dict], device: str, path: Path | None = None) -> Path:
    """gemm_<device>.json (the module docstring's format), with this process's torch, CUDA and GPU."""
    import torch

    path = path or table_path(device)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    header = {"device": device, "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": datetime.date.today().isoformat()}
    path.write_text(rows_json(header, rows))
    return path


def rows_json(header: dict, rows: list[dict]) -> str:
    """`header`'s keys, then "rows": one row a line, so that a table reads and diffs by row."""
    fields = "".join(f" {json.dumps(key)}: {json.dumps(value)},\n" for key, value in header.items())
    lines = ",\n".join(f"  {json.dumps(row)}" for row in rows)
    return f'{{\n{fields} "rows": [\n{lines}\n ]\n}}\n'
