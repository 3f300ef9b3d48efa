"""Whole training steps measured on GPUs (measured_steps.json): what `plan`'s step time and peak memory are
checked against (tests/planner/test_step_time.py), and what makes a plan's time "calibrated".

A row is one layout of one config on one device, as the trainer ran it: `trainer` "scaletrain" or
"plain_pytorch" (benchmarks/gpt_throughput.py's reference loop: fused AdamW on fp32 weights under autocast,
hence its larger memory, which the planner does not model), the step time in ms and the peak memory in GiB
(null where not measured). `optimizer` names the optimizer implementation that ran ("flat_adamw":
train/flat_adamw.py; "torch_fused_adamw": the plain loop's); those in `SUPERSEDED_OPTIMIZERS` ran before a fix
that the step-time model assumes, and their step times are kept as a record, not as targets.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import Config
from scaletrain.config_loader import load_config
from scaletrain.planner.activations import Recompute
from scaletrain.planner.kernel_time import rows_json

STEPS_FILE = Path(__file__).with_name("measured_steps.json")
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # a row's config is a file name in it
# DeepSpeed's bf16 ZeRO-0 wrapper, converting, clipping and copying per tensor: ~67-75 ms/step more than
# FlatAdamW at GPT-3 350M on an H200
SUPERSEDED_OPTIMIZERS = frozenset({"deepspeed_unfused"})
RECOMPUTE = {recompute.setting: recompute for recompute in Recompute}  # a row's `recompute` as a Candidate's


@dataclass(frozen=True)
class MeasuredStep:
    device: str  # kernel_time.DEVICES key, e.g. "h200"
    config: str  # file name in configs/, e.g. "gpt3_350m.yaml"
    trainer: str  # "scaletrain" or "plain_pytorch"
    micro_batch: int
    grad_accum: int
    recompute: str  # train.activation_checkpoint: "none", "selective" or "full"
    seq: int
    step_ms: float
    peak_gib: float | None
    optimizer: str
    torch: str
    cuda: str
    date: str
    note: str = ""

    @property
    def current(self) -> bool:
        """Measured with what scaletrain runs now (or the plain loop), so the step-time model should match it."""
        return self.optimizer not in SUPERSEDED_OPTIMIZERS

    def load_config(self) -> Config:
        """The row's config at its layout: one GPU, its micro-batch, grad_accum and sequence length."""
        return load_config(CONFIG_DIR / self.config, [
            f"train.global_batch_size={self.micro_batch * self.grad_accum}", f"model.seq_length={self.seq}",
        ])


def measured_steps(path: Path = STEPS_FILE) -> list[MeasuredStep]:
    return [MeasuredStep(**row) for row in json.loads(path.read_text())["rows"]]


def append_measured_step(step: MeasuredStep, path: Path = STEPS_FILE) -> None:
    """Add a row (the GPU check's), keeping the file's description and earlier rows."""
    if not (CONFIG_DIR / step.config).exists():
        raise ValueError(f"config {step.config!r} is not a file in {CONFIG_DIR}; name one, e.g. gpt3_350m.yaml")
    if step.recompute not in RECOMPUTE:
        raise ValueError(f"recompute={step.recompute!r}; use one of {', '.join(RECOMPUTE)}")
    document = json.loads(path.read_text())
    rows = document.pop("rows")
    path.write_text(rows_json(document, [*rows, dataclasses.asdict(step)]))
    _measured_models.cache_clear()


def has_measured_step(config: Config, device: str | None) -> bool:
    """Whether a current row measured this model (its `model:` section and vocabulary) on `device`."""
    return device is not None and (device, _model_key(config)) in _measured_models()


@functools.lru_cache(maxsize=1)
def _measured_models() -> frozenset[tuple[str, str]]:
    if not CONFIG_DIR.is_dir():  # an installed package without the repository's configs
        return frozenset()
    return frozenset((step.device, _model_key(step.load_config())) for step in measured_steps() if step.current)


def _model_key(config: Config) -> str:
    return repr((config.model, config.padded_vocab_size))
