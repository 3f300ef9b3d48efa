"""Typed run configuration: the schema, YAML files + dotted CLI overrides, and the rules on its own keys.

This module sits below every other package and imports none of them: model/, data/ and parallel/
import it. What it cannot know is handed to it. Which model families exist and what each family's
`model:` section holds come from the family registry as a mapping {family name -> ModelConfig
subclass} (`read_config(..., model_sections)`, families/__init__.py MODEL_SECTIONS). The rules that
are other packages' facts (a family's own keys, the tokenizer's reserved ids, DeepSpeed's pipeline
rules, the `pipe:` location syntax) live in those packages, and config_loader.py, above them all,
runs them after `validate_keys`: `scaletrain.config_loader.load_config` is the one way to load a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml


class ConfigError(ValueError):
    """A configuration value a user must fix; the message names the key and the fix."""


class ConfigWarning(UserWarning):
    """A value load_config adjusted rather than refused (a warmup cut to fit a shortened run);
    the CLI shows it as one `warning:` line, from rank 0 only (notices.py silences other ranks)."""


@dataclass(frozen=True)
class Allowed:
    """The values a numeric key may take, declared beside its field with `bounded` and checked for every
    key of every section before anything is built (validate_keys). A float key must also be finite, bounded
    or not: NaN compares false with any bound (so `x < 0` lets it through) and inf passes a lower one."""

    text: str  # as declared and as the error prints it: ">= 1", "> 0", "[0, 1)", "(0, 1)", "[0, 600]"
    note: str = ""  # what the user should know to pick a value: the usual one, what 0 or null means
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    @classmethod
    def parse(cls, text: str, note: str = "") -> Allowed:
        if text.startswith((">= ", "> ")):
            operator, bound = text.split(" ")
            return cls(text, note, low=float(bound), low_open=operator == ">")
        low, high = text[1:-1].split(", ")
        return cls(text, note, float(low), float(high), text[0] == "(", text[-1] == ")")

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    @property
    def phrase(self) -> str:
        """`>= 1`, `in [0, 1)`: what follows `must be` in a message and a key's type in the schema."""
        return self.text if self.text.startswith(">") else f"in {self.text}"

    def refusal(self, key: str, value: float) -> str:
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        note = f" ({self.note})" if self.note else ""
        return f"{key}={value} must be {finite}{self.phrase}{note}"


def bounded(default: Any, allowed: str, note: str = "") -> Any:
    """A numeric field with the values it may take (`Allowed.text`) declared where the field is;
    `dataclasses.MISSING` as the default for a field that must be given."""
    return field(default=default, metadata={"allowed": Allowed.parse(allowed, note)})


@dataclass
class ObjectiveConfig:
    """What the model learns: the `objective:` section every family has. A family whose objectives take
    settings extends it, as its `model:` section extends ModelConfig, and names the class as its model
    section's `objective_section` (model/encoder.py MaskedLMObjective for BERT and ALBERT, MaskingObjective
    for ELECTRA; families/t5/model.py SpanCorruptionObjective; families/bart/model.py DenoisingObjective).
    GPT and Llama have this section as it is."""

    # auto (the family's first) | causal_lm | prefix_lm (GPT, Llama, T5) | mlm (BERT, ALBERT) |
    # replaced_token_detection (ELECTRA) | span_corruption (T5) | denoising (BART)
    kind: str = "auto"

    @property
    def reads_sentence_pairs(self) -> bool:
        """Whether samples are sentence pairs (NSP/SOP) instead of packed text: only a masked LM's can be."""
        return False

    def validate(self) -> None:
        """How the section's keys relate (each number's range is declared with it); nothing to check here."""


# The flat `objective:` section of configs saved before each family had its own (2026-11-28): every family's
# keys side by side (FLAT_OBJECTIVE_KEYS; those of FLAT_SAVED_KEYS in every version since 2026-11-22). A stored
# run.yaml or checkpoint config.yaml holds them all; reading one keeps the keys its family's section has and
# drops the others, which its run never read (_objective_keys_read).
FLAT_OBJECTIVE_KEYS = frozenset({
    "kind", "mask_prob", "whole_word_masking", "span_masking", "span_boundary", "sentence_pairs", "noise_density",
    "mean_noise_span_length", "noising", "infilling_ratio", "infilling_poisson_lambda", "deletion_ratio"})
FLAT_SAVED_KEYS = frozenset({"kind", "mask_prob", "whole_word_masking", "sentence_pairs", "noise_density",
                             "mean_noise_span_length"})


@dataclass
class ModelConfig:
    """What every family's `model:` section has; each family's model.py extends it with its own keys
    (families/<name>/model.py: GPTConfig, BertConfig, T5Config, LlamaConfig, ...)."""

    # the family's `objective:` section (a subclass of ObjectiveConfig where its objectives take settings)
    objective_section: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig

    family: str = "gpt"
    num_layers: int = bounded(2, ">= 1")  # transformer blocks (T5: encoder blocks)
    hidden_size: int = bounded(128, ">= 1")
    num_heads: int = bounded(4, ">= 1")  # attention heads
    head_dim: int | None = bounded(None, ">= 1", "or null: hidden_size / num_heads")  # None: hidden_size / num_heads
    ffn_hidden_size: int | None = bounded(None, ">= 1", "or null for the default")  # None: 4 * hidden_size (GPT-2/3)
    seq_length: int = bounded(128, ">= 1")  # tokens per training sequence
    # Megatron pads the vocabulary so every tensor-parallel shard has equal rows; we pad to a
    # multiple that does not depend on the layout, so all layouts build identical weights.
    vocab_divisible_by: int = bounded(128, ">= 1", "e.g. 128")
    dropout: float = bounded(0.0, "[0, 1)")
    layernorm_eps: float = bounded(1e-5, "> 0", "e.g. 1e-5")
    init_std: float = bounded(0.02, "> 0", "GPT-2: 0.02")  # std of the normal weight init (GPT-2)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def num_query_groups(self) -> int:
        """Key/value heads; families with grouped-query attention override it."""
        return self.num_heads


ModelSections = Mapping[str, type[ModelConfig]]  # family name -> its typed `model:` section


@dataclass
class BlendEntry:
    """One prepared dataset of a blend and its share of the training samples."""

    dir: str  # a prepared dataset, as data.dir
    weight: float = bounded(dataclasses.MISSING, "> 0")  # relative: weights are normalised over the blend
    name: str | None = None  # in per-dataset metrics (val_loss/NAME); default: the last part of dir

    @property
    def label(self) -> str:
        """The name per-dataset metrics carry: `name`, else the last part of `dir` (a path or a URL)."""
        return self.name or self.dir.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class DataConfig:
    dir: str = "data/gpt_tiny"  # tokenizer + shards + manifest
    raw: list[str] = field(default_factory=list)  # text files, directories or globs for `prepare`
    vocab_size: int = 8192  # sentencepiece pieces + sentinels
    num_sentinels: int = bounded(100, ">= 0")  # T5 <extra_id_i>, appended at the end of the vocabulary
    val_fraction: float = bounded(0.05, "[0, 1)")  # share of the documents `prepare` holds out for validation
    max_tokens_per_shard: int = bounded(1 << 22, ">= 1")  # `prepare` starts a new shard file after this many tokens
    prepare_workers: int = bounded(2, ">= 1")  # sentencepiece threads that tokenize during `prepare`
    dedup: bool = True  # `prepare` drops documents whose normalised text an earlier one has (exact dedup)
    tokenizer: str | None = None  # a sentencepiece .model to reuse (e.g. another dataset's tokenizer.model)
    # train the tokenizer on a seeded sample of about this many bytes
    tokenizer_train_bytes: int | None = bounded(None, ">= 1", "or null to train the tokenizer on the whole corpus")
    loader_workers: int = bounded(1, ">= 0")  # data loader processes per rank (0: load in the training process)
    # data.dir may be a URL (https://, s3://, gs://, file://) or 'pipe:COMMAND {file}' (data/storage.py);
    # remote shards are downloaded whole into this cache and memory-mapped. null: $SCALETRAIN_CACHE or
    # ~/.cache/scaletrain. The limit covers all datasets in the cache; least recently used files go first.
    cache_dir: str | None = None
    cache_limit_gb: float = bounded(100.0, "> 0", "it should hold at least the shards one node reads at once, about "
                                                  "loader_workers x ranks per node shards")
    # after a dropped connection, HTTP 5xx or truncated body; backoff doubles
    download_retries: int = bounded(4, ">= 0")
    download_backoff_s: float = bounded(1.0, "[0, 600]")
    # a transfer that receives no byte for this long (a server that accepts and stalls) is abandoned, then retried
    download_timeout_s: float = bounded(60.0, "> 0")
    # Train on a weighted mix of prepared datasets (Megatron's --data-path 0.3 A 0.7 B) instead of dir:
    # [{dir: data/fineweb_edu, weight: 0.7}, {dir: data/wikipedia, weight: 0.3}]. All must share one tokenizer.
    blend: list[BlendEntry] = field(default_factory=list)

    def sources(self) -> list[BlendEntry]:
        """The datasets a run trains on: the blend's, or data.dir alone with weight 1."""
        return self.blend or [BlendEntry(self.dir, 1.0)]


@dataclass
class ParallelConfig:
    tensor: int = bounded(1, ">= 1")  # tensor-parallel ranks (Megatron): each layer's weights split over them
    pipeline: int = bounded(1, ">= 1")  # pipeline stages (DeepSpeed PipelineModule)
    # None: derived as world_size / (tensor * context * pipeline)
    data: int | None = bounded(None, ">= 1", "or null to derive it")
    zero_stage: int = bounded(1, "[0, 3]")  # DeepSpeed ZeRO stage 0-3: what data-parallel ranks partition
    # How DeepSpeed splits layers into stages: parameters | uniform | blocks (equal block counts),
    # or blocks per stage as a list, e.g. "5,7" (the embedding joins the first stage, the head the last).
    pipeline_partition: str = "parameters"
    # Sequence parallelism (Korthikanti et al. 2022): norms, dropout and residuals of each block work on
    # 1/tensor of the sequence; megatron's linears all-gather / reduce-scatter instead of all-reducing.
    sequence_parallel: bool = False
    # Expert parallelism: each MoE layer's experts are split over this many data-parallel ranks, which
    # exchange tokens by all-to-all (GShard; DeepSpeed-MoE). Carved out of the data-parallel ranks, as
    # DeepSpeed and Megatron do: it must divide them and model.moe.num_experts; the world size is unchanged.
    expert: int = bounded(1, ">= 1")
    # Context parallelism: each sequence split over this many ranks, attention computed by ring attention
    # (Liu et al. 2023). A grid dimension of its own between TP and DP (Megatron's order tp-cp-dp-pp).
    context: int = bounded(1, ">= 1")
    # How long a collective may wait for another rank before it fails (torch.distributed's process-group
    # timeout). A rank lost with its host (link down, node dead) is detected only this way: every other
    # rank waits this long, then exits naming it (train/peer_loss.py). Long enough for the slowest
    # legitimate wait: a first step's JIT builds, a checkpoint saved by rank 0 while others wait.
    timeout_s: float = bounded(1800.0, "> 0", "seconds a collective may wait for another rank; 1800 by default")


@dataclass
class SpikeConfig:
    """Loss spikes with finite numbers (train/spikes.py): a step whose loss is more than skip_sigma robust
    deviations above the trailing window is skipped (no update; its batch is consumed, as a non-finite
    step's); `patience` such steps in a row are a divergence, which stops the run naming the last good
    checkpoint, or with `rewind` reloads that checkpoint and skips `rewind_skip_batches` batches (PaLM,
    Chowdhery et al. 2022, sec. 5.1), at most `max_rewinds` times."""

    # OLMo-core's sigma_factor; null turns the rule off
    skip_sigma: float | None = bounded(6.0, "> 0", "OLMo-core: 6; null turns spike skipping off")
    window: int = bounded(128, ">= 1", "OLMo-core: 128 steps")  # accepted losses the rule compares with
    # the band's least half-width, as a fraction of the window's median loss (a flat window's noise floor)
    min_deviation: float = bounded(0.05, "[0, 1)", "0.05: a spike is at least 30% above the median at 6 sigma")
    patience: int = bounded(8, ">= 1", "spike-skipped steps in a row that are a divergence")
    rewind: bool = False  # on a divergence, go back to the last good checkpoint instead of stopping
    rewind_skip_batches: int = bounded(200, ">= 0", "PaLM skipped 200-500 batches")
    max_rewinds: int = bounded(3, ">= 1")
    # Fault injection for tests: on these global batches of the data order (1-based: the step's number until a
    # rewind skips data) the first data-parallel rank's micro-batch losses are multiplied by inject_factor, a
    # bad batch the rule must catch. Leave empty.
    inject_at: list[int] = field(default_factory=list)
    inject_factor: float = bounded(100.0, "> 0")


@dataclass
class TrainConfig:
    steps: int = bounded(100, ">= 1")  # length of the LR schedule and of the run
    # stop after this many steps in this invocation (checkpointing first)
    exit_after: int | None = bounded(None, ">= 1", "or null for no early exit")
    # stop once this invocation has run this long (Megatron's --exit-duration-in-mins), checkpointing first
    exit_after_minutes: float | None = bounded(None, "> 0", "or null for no wall-clock limit")
    # signals that stop the run at the next step boundary with a checkpoint (SLURM preemption and time
    # limits, torchrun's SIGTERM, Ctrl-C)
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    seed: int = 1234  # weights and data order
    lr: float = bounded(6e-4, "> 0")  # peak learning rate
    min_lr: float = bounded(6e-5, ">= 0")  # the learning rate at the end of the decay
    warmup_steps: int = bounded(0, ">= 0")  # the LR rises linearly to train.lr over this many steps
    # the warmup as a fraction of train.steps instead, so a shortened or lengthened run keeps its shape
    # (Megatron-LM's --lr-warmup-fraction, HF Trainer's warmup_ratio). A key of its own rather than a
    # warmup_steps below 1: the name says the unit, and no value changes meaning at 1 (is 1.0 one step or
    # the whole run?). Set one of the two; a YAML file or override that sets one replaces the other.
    warmup_fraction: float | None = bounded(None, "[0, 1)", "a fraction of train.steps; 0.01-0.1 is usual; for a "
                                                            "warmup in steps set train.warmup_steps")
    # cosine: warmup, then cosine decay to min_lr at train.steps (GPT-3). wsd: warmup, constant, then a
    # cooldown over the last cooldown_fraction of the steps (train/schedule.py); a WSD run can be
    # continued past its stable phase, which is what cooldown branches and ladder sweeps use.
    lr_schedule: str = "cosine"
    # wsd: Hägele et al. 2024 find a 20% 1-sqrt cooldown matches cosine
    cooldown_fraction: float = bounded(0.2, "[0, 1)", "0.2 is the usual WSD cooldown; 0 keeps the LR constant "
                                                      "after warmup")
    cooldown_shape: str = "sqrt"  # wsd: sqrt (lr falls as 1 - sqrt(progress)) | linear
    # A checkpoint directory (RUN/checkpoints/step_NNNNNNNN) this run starts from when it has no
    # checkpoint of its own: a cooldown branch of a WSD run (weights, optimizer, step, data position, RNG).
    branch_from: str | None = None
    weight_decay: float = bounded(0.1, ">= 0", "AdamW: 0.1 is usual, 0 for none")  # AdamW's decoupled weight decay
    beta1: float = bounded(0.9, "[0, 1)", "AdamW's first-moment decay; 0.9 is usual")
    beta2: float = bounded(0.95, "[0, 1)", "AdamW's second-moment decay; 0.95 or 0.999 are usual")
    grad_clip: float = bounded(1.0, ">= 0", "0 disables clipping")  # clip the global gradient norm to this
    micro_batch_size: int = bounded(4, ">= 1")  # sequences per rank per forward/backward pass
    grad_accum: int = bounded(1, ">= 1")  # micro-batches per optimizer step
    # Megatron-style alternative to grad_accum: fix the global batch and derive grad_accum from
    # the data-parallel size at launch, so the same config trains the same way at any scale.
    global_batch_size: int | None = bounded(None, ">= 1")
    resume: str = "auto"  # auto | never | path to a checkpoint directory
    init_from: str | None = None  # weights file from `scaletrain import`, loaded when a run starts fresh
    eval_every: int = bounded(50, ">= 0", "0 disables validation")  # 0 disables periodic validation
    # Validation sequences per evaluation: `all` reads the whole split (every sequence once, the loss the
    # token-weighted mean over it); a number below the split's size reads a random sample of that many,
    # drawn without replacement from eval_seed alone (not train.seed), so every run of a sweep, every layout
    # and every resume reads the same sequences; a number at least the split's size reads all of it
    eval_samples: int | str = bounded(64, ">= 1", "or all for the whole validation split")
    # seeds the draw of that sample (train/evaluation.py); runs compared or fitted together keep the same one
    eval_seed: int = bounded(0, ">= 0")
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # What backward recomputes instead of keeping (Korthikanti et al. 2022): none; selective, each block's
    # attention core (softmax(QK^T)V) from its kept q, k, v (sec. 4.3); full, every block from its input
    # (sec. 4.2); auto, the least of these that plan's memory model fits on the GPU, decided at start
    # (none on CPU). null (unset): full if activation_checkpoint_interval > 0, else none, as configs
    # written before this key meant.
    activation_checkpoint: str | None = None
    # full recomputation's chunk: blocks recomputed together, keeping only the chunk's input (0: 1 block);
    # set alone (> 0) it means activation_checkpoint=full
    activation_checkpoint_interval: int = 0
    # logits + loss over this many tokens at a time, recomputed in backward; 0 = off
    loss_chunk_size: int = bounded(0, ">= 0", "tokens per chunk of the chunked loss, e.g. 4096; 0 computes the "
                                              "logits of the whole micro-batch at once")
    compile: bool = False  # torch.compile each transformer block on its own (train/compile.py); the first steps compile
    # a plain progress line on stderr every this many steps when stderr is not a terminal (SLURM, CI),
    # besides the first and last step; metrics.jsonl, W&B and TensorBoard get every step
    log_every: int = bounded(10, ">= 1")
    # A step whose loss or gradient norm is non-finite is skipped (no update; its batch is consumed);
    # this many skipped in a row stop the run (exit 3), naming the last good checkpoint.
    max_skipped_steps: int = bounded(10, ">= 1")
    # Fault injection for tests (in the spirit of Megatron-LM's --error-injection-rate): at these
    # steps (1-based, as logged) the first data-parallel rank's loss is made NaN. Leave empty.
    inject_nonfinite_loss_at: list[int] = field(default_factory=list)
    spike: SpikeConfig = field(default_factory=SpikeConfig)

    @property
    def recompute(self) -> str:
        """none | selective | full | auto: activation_checkpoint, or where only the interval is set (a
        config from before that key) full if the interval is > 0, else none."""
        if self.activation_checkpoint is not None:
            return self.activation_checkpoint
        return "full" if self.activation_checkpoint_interval else "none"

    @property
    def full_recompute_interval(self) -> int:
        """Blocks per recomputed chunk under full recomputation (the interval, 1 if unset); 0 otherwise."""
        return max(self.activation_checkpoint_interval, 1) if self.recompute == "full" else 0

    @property
    def cooldown_steps(self) -> int:
        """Steps of the WSD cooldown at the end of the run (0 for cosine, or wsd with no cooldown)."""
        return cooldown_steps(self.steps, self.cooldown_fraction) if self.lr_schedule == "wsd" else 0

    @property
    def requested_warmup_steps(self) -> int:
        """The warmup as the config asks for it: warmup_fraction x steps (rounded), else warmup_steps."""
        if self.warmup_fraction is None:
            return self.warmup_steps
        return round(self.warmup_fraction * self.steps)

    @property
    def longest_warmup_steps(self) -> int:
        """The longest warmup this run has room for: one step short of the run, and none of the WSD cooldown."""
        return max(0, min(self.steps - 1, self.steps - self.cooldown_steps))

    @property
    def resolved_warmup_steps(self) -> int:
        """The warmup the LR schedule runs: the requested one, cut to the room the run has.

        A derived value, like cooldown_steps, rather than a value written into the config at load:
        the schedule stays a function of (step, config), so a resumed run whose train.steps changed
        follows the warmup of its new length, and the config written to the run directory is the one
        the user wrote. A cooldown branch (train.branch_from) is never cut: its warmup is its stable
        run's, and a different one would not continue that run (validation refuses it instead).
        """
        if self.branch_from:
            return self.requested_warmup_steps
        return min(self.requested_warmup_steps, self.longest_warmup_steps)


LR_SCHEDULES = ("cosine", "wsd")
COOLDOWN_SHAPES = ("sqrt", "linear")


def cooldown_steps(steps: int, fraction: float) -> int:
    """round(fraction x steps): the one rounding a run's schedule and a ladder's branch points share."""
    return round(fraction * steps)


@dataclass
class CheckpointConfig:
    every: int = bounded(100, ">= 1")  # checkpoint interval in steps (also at the end and whenever a run stops early)
    keep_last: int = bounded(2, ">= 1")  # newest checkpoints kept; older ones are pruned
    # steps that are also checkpointed and never pruned: the branch points of a WSD run's cooldowns
    keep_steps: list[int] = field(default_factory=list)
    # write in the background: a save stalls training only while its state is copied off (a step's
    # time or less), and the files of checkpoint k are written while the steps after k train
    async_save: bool = True


@dataclass
class TrackingConfig:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "scaletrain"
    name: str | None = None
    # W&B grouping, for sweeps and for any set of related runs (W&B's group, tags and job_type).
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    job_type: str = "train"
    # per-device peak for MFU where the device is not recognised
    peak_tflops: float | None = bounded(None, "> 0", "or null to recognise the device")
    # also write W&B's namespaced metrics as TensorBoard event files under RUN_DIR/tensorboard/, for
    # clusters without W&B (tracking/tensorboard_sink.py)
    tensorboard: bool = False


@dataclass
class EvalConfig:
    """Downstream evaluation in the training loop (train/hooks/downstream.py): lm-evaluation-harness tasks scored
    on the training model in place, as `scaletrain eval RUN --tasks` scores a checkpoint of the same step."""

    # lm-eval task names, task YAML files or directories of them, as `scaletrain eval --tasks` takes them (e.g.
    # [configs/eval_tasks/shakespeare_passages.yaml]); empty: no downstream evaluation. Needs scaletrain[eval]
    tasks: list[str] = field(default_factory=list)
    # directories of local task YAMLs that names in eval.tasks refer to (eval --include-path)
    include_path: list[str] = field(default_factory=list)
    # evaluate every this many steps, at step 0 of a fresh run and at the last step; 0: at the last step only
    every: int = bounded(0, ">= 0", "0 evaluates at the last step only")
    # documents per task: a number, or a fraction of each task's below 1 (eval --limit); null: every document
    limit: float | None = bounded(None, "> 0", "or null for every document")
    num_fewshot: int | None = bounded(None, ">= 0", "or null for each task's own")  # few-shot examples
    batch_size: int = bounded(8, ">= 1")  # requests per forward (eval --batch-size)


@dataclass
class RunConfig:
    dir: str = "runs/gpt_tiny"  # checkpoints, config.yaml, metrics.jsonl, the trackers' files


@dataclass
class Config:
    """A run. `Config()` has the shared model keys only (the default family, gpt, adds none); a config
    read from YAML has its family's section class (read_config's model_sections)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.model.vocab_divisible_by
        return math.ceil(self.data.vocab_size / multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading


def read_config(path: str | Path, overrides: list[str] | tuple[str, ...], model_sections: ModelSections) -> Config:
    """Read a YAML config (following `base:` includes) and apply `a.b=value` overrides, into typed sections;
    the `model:` section is read as its family's class from `model_sections`. Not validated: see
    config_loader.load_config, which reads through here and then runs every package's rules.

    An error about a key names where its value came from: the override that set it, else the file.
    """
    raw = _read_yaml_with_bases(Path(path), seen=())
    set_by: dict[str, str] = {}
    for override in overrides:
        set_by[_apply_override(raw, override)] = override
    return _build_dataclass(Config, raw, prefix="", reading=_Reading(str(path), model_sections, set_by))


def parse_config(raw: dict[str, Any], model_sections: ModelSections, source: str = "config") -> Config:
    """A Config from a mapping as YAML would hold it (tests, measurements); not validated, as read_config."""
    return _build_dataclass(Config, raw, prefix="", reading=_Reading(source, model_sections))


@dataclass(frozen=True)
class _Reading:
    """What reading a tree needs besides the tree: where each key's value came from, for the error that
    names it (an override, else the file), and the families' `model:` sections."""

    file: str
    model_sections: ModelSections = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)  # dotted key -> the override that set it last

    def of(self, key: str) -> str:
        """The override that set `key` or a section or list holding it (data.blend=[...]), else the file."""
        setters = [override for set_key, override in self.overrides.items()
                   if key == set_key or key.startswith((f"{set_key}.", f"{set_key}["))]
        return f"override {setters[-1]}" if setters else self.file


# Sibling keys that say one thing two ways: a layer (a YAML file over its base, an override over the
# files) that sets one drops the other from below it; one layer that sets both is refused (_validate_warmup).
ALTERNATIVES = {("train", "warmup_steps"): "warmup_fraction", ("train", "warmup_fraction"): "warmup_steps"}


def save_config(config: Config, path: Path) -> None:
    path.write_text(config_yaml(config))


def config_yaml(config: Config) -> str:
    """Every key with its value, defaults included, as YAML that load_config reads back to the same Config."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def derived_comment(config: Config) -> str:
    """What the keys work out to, as a YAML comment for `scaletrain config`: the warmup a fraction
    gives or a short run cuts (TrainConfig.resolved_warmup_steps), the cooldown, the padded vocabulary."""
    train = config.train
    return (f"# derived: warmup {train.resolved_warmup_steps} steps, WSD cooldown {train.cooldown_steps} steps, "
            f"padded vocabulary {config.padded_vocab_size}\n")


# A YAML alias (*name) stands for its anchor's (&name) whole value, so nine nested levels of ten aliases
# each make 10^9 values of a few hundred bytes (the "billion laughs"). PyYAML shares the repeated objects,
# but every walk of the tree (merging bases, building the sections, printing the config) visits each copy:
# a 473-byte file ran `scaletrain config` past 60 s and 4.5 GB. A run config has a few hundred values.
MAX_YAML_VALUES = 100_000


def read_yaml(text: str, source: str) -> Any:
    """yaml.safe_load, refusing a document whose aliases expand it past MAX_YAML_VALUES values (or into
    itself) before anything is built from it; a syntax error is yaml's, for the caller to name."""
    loader = yaml.SafeLoader(text)
    try:
        document = loader.get_single_node()
        if document is None:
            return None
        _count_expanded_values(document, source, counted={}, open_nodes=set())
        return loader.construct_document(document)
    finally:
        loader.dispose()


def _count_expanded_values(node: yaml.Node, source: str, counted: dict[int, int], open_nodes: set[int]) -> int:
    """The values under `node` with every alias expanded, each node counted once (`counted`), so the
    work is the document's size, not its expansion's."""
    if id(node) in counted:
        return counted[id(node)]
    if id(node) in open_nodes:
        raise ConfigError(f"{source}: a YAML alias (*name) refers to a value that holds it; write the value out")
    open_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1 + sum(_count_expanded_values(child, source, counted, open_nodes) for child in children)
    open_nodes.discard(id(node))
    if total > MAX_YAML_VALUES:
        raise ConfigError(
            f"{source}: its YAML aliases (*name) expand to more than {MAX_YAML_VALUES:,} values; write the "
            "values out (a run config has a few hundred), or share sections between files with `base:`"
        )
    counted[id(node)] = total
    return total


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def _read_yaml_with_bases(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a YAML file such as configs/gpt_tiny.yaml")
    if path.resolve() in seen:
        raise ConfigError(f"config {path} includes itself through `base:`; remove the cycle")
    try:
        raw = read_yaml(path.read_text(), f"config file {path}") or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    parent = _read_yaml_with_bases(path.parent / base, seen + (path.resolve(),))
    return _deep_merge(_without_replaced(parent, raw), raw)


def _without_replaced(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """`base` less the keys whose alternative `layer` sets (ALTERNATIVES)."""
    dropped = {(section, other) for (section, key), other in ALTERNATIVES.items()
               if isinstance(layer.get(section), dict) and layer[section].get(key) is not None}
    return {name: {key: item for key, item in value.items() if (name, key) not in dropped}
            if isinstance(value, dict) else value for name, value in base.items()}


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _apply_override(raw: dict[str, Any], override: str) -> str:
    """Set one dotted key in the raw tree; returns the key."""
    key, sep, text = override.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(f"override {override!r} must look like section.key=value, e.g. train.lr=3e-4")
    *sections, leaf = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {section} is not a section")
    try:
        node[leaf] = read_yaml(text, f"override {override!r}") if text != "" else None
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({_first_line(error)})") from None
    if node[leaf] is not None and len(sections) == 1 and (sections[0], leaf) in ALTERNATIVES:
        node.pop(ALTERNATIVES[sections[0], leaf], None)
    return key


def _build_dataclass(cls: type, raw: Any, prefix: str, reading: _Reading) -> Any:
    if not isinstance(raw, dict):
        section = prefix.rstrip(".")
        raise ConfigError(f"{reading.of(section)}: {section or 'top level'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ConfigError(_unknown_key_message(cls, prefix, unknown[0], names, reading))
    if cls is Config:
        # the model and objective sections are their family's classes also when the file has none
        raw = {"model": {}, "objective": {}, **raw}
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if cls is Config and name == "model":
            hint = _model_section_class(value, reading)
        if cls is Config and name == "objective":
            hint = _model_section_class(raw["model"], reading).objective_section
            value = _objective_keys_read(value, hint)
        nested = _nested_dataclass(hint, value)
        if nested is not None:
            values[name] = _build_dataclass(nested, value, f"{prefix}{name}.", reading)
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}", reading)
    return cls(**values)


def _objective_keys_read(raw: Any, section: type[ObjectiveConfig]) -> Any:
    """The `objective:` mapping as `section` reads it: a stored config's flat section (FLAT_SAVED_KEYS and
    others of FLAT_OBJECTIVE_KEYS, as configs were saved before each family had its own) less the keys `section` lacks,
    which that run's family never read; any other mapping as it is, its unknown keys refused by the reader."""
    if not isinstance(raw, dict) or not FLAT_SAVED_KEYS <= set(raw) <= FLAT_OBJECTIVE_KEYS:
        return raw
    kept = {f.name for f in dataclasses.fields(section)}
    return {key: value for key, value in raw.items() if key in kept}


def _unknown_key_message(cls: type, prefix: str, name: str, names: list[str], reading: _Reading) -> str:
    """Names the key and its source, with the closest valid key (difflib), the family that has it, or the list."""
    key, section = f"{prefix}{name}", prefix.rstrip(".") or "the top level"
    message = f"{reading.of(key)}: unknown key {key}"
    close = difflib.get_close_matches(name, names, n=1)
    families = []
    if issubclass(cls, ModelConfig):
        families = _families_with_key(name, reading.model_sections)
    elif issubclass(cls, ObjectiveConfig):
        families = _families_with_key(name, reading.model_sections, objective=True)
    if families:
        return f"{message} (model.family={' or '.join(families)} has it, this config's family does not)"
    elsewhere = _sections_with_key(name) if cls in _section_classes() else []
    if elsewhere:
        return f"{message} (it belongs under {' or '.join(elsewhere)}: write {elsewhere[0]}.{name})"
    if close:
        return f"{message} (did you mean {prefix}{close[0]}?)"
    return f"{message}; valid keys under {section} are: {', '.join(sorted(names))}"


def _section_classes() -> set[type]:
    hints = typing.get_type_hints(Config)
    return {hints[section.name] for section in dataclasses.fields(Config)}


def _sections_with_key(name: str) -> list[str]:
    """The top-level sections (other than model:, whose keys depend on the family) that have the key:
    `train.zero_stage` is `parallel.zero_stage`."""
    hints = typing.get_type_hints(Config)
    return [section.name for section in dataclasses.fields(Config)
            if section.name not in ("model", "objective")
            and name in {f.name for f in dataclasses.fields(hints[section.name])}]


def _families_with_key(name: str, model_sections: ModelSections, objective: bool = False) -> list[str]:
    """The families whose `model:` section (or `objective:` section) has the key."""
    return [family for family, section in model_sections.items()
            if name in {f.name for f in dataclasses.fields(section.objective_section if objective else section)}]


def _model_section_class(raw: Any, reading: _Reading) -> type:
    """The `model:` section's schema is its family's config class (e.g. llama adds num_kv_heads)."""
    family = raw.get("family", ModelConfig.family) if isinstance(raw, dict) else ModelConfig.family
    if family not in reading.model_sections:
        raise ConfigError(f"{reading.of('model.family')}: model.family={family!r} is not supported; use one of "
                          f"{', '.join(reading.model_sections)}")
    return reading.model_sections[family]


def _nested_dataclass(hint: Any, value: Any) -> type | None:
    """The dataclass a field holds: `Section` or, for a set value, `Section | None`."""
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType) and value is not None:
        return next((option for option in typing.get_args(hint) if dataclasses.is_dataclass(option)), None)
    return None


def build_dataclass(cls: type, raw: Any, prefix: str, source: str) -> Any:
    """A typed dataclass from a YAML mapping; unknown keys and wrong types raise ConfigError.

    Shared by the run config and other YAML schemas (sweep specs), so both report errors alike.
    """
    return _build_dataclass(cls, raw, prefix, _Reading(source))


def _coerce_item(value: Any, hint: Any, key: str, reading: _Reading) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build_dataclass(hint, value, f"{key}.", reading)
    if hint is str and not isinstance(value, (dict, list)):
        return str(value)
    return _coerce(value, hint, key, reading)


def _coerce(value: Any, hint: Any, key: str, reading: _Reading) -> Any:
    """Check a YAML value against a field's type; ints are accepted where floats are expected."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{reading.of(key)}: {key} must be set (got null)")
    for option in options:
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is float and isinstance(value, str) and _is_float(value):
            return float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option in (str, bool) and isinstance(value, option):
            return value
        if typing.get_origin(option) is list and isinstance(value, list):
            (item_hint,) = typing.get_args(option)
            return [_coerce_item(item, item_hint, f"{key}[{index}]", reading) for index, item in enumerate(value)]
        if option is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    expected = " or ".join(getattr(o, "__name__", str(o)) for o in options if o is not type(None))
    raise ConfigError(f"{reading.of(key)}: {key} must be {expected}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Validation of what config.py itself knows: each key's range and how keys relate. The rules that are
# other packages' facts are theirs; config_loader.validate runs them after these.

def validate_keys(config: Config) -> None:
    """The rules that need nothing but the config; every numeric key's range first (`bounded`), since
    the rules after it compare and divide keys."""
    _validate_numbers(config, prefix="")
    _validate_model(config)
    config.objective.validate()  # its section's own rules; which kinds a family trains: validate_for_family
    _validate_train(config)
    _validate_schedule(config.train)
    _validate_data(config.data)
    _validate_eval(config)
    outside = [step for step in config.checkpoint.keep_steps if not 1 <= step <= config.train.steps]
    if outside:
        raise ConfigError(f"checkpoint.keep_steps has {outside}, outside [1, train.steps={config.train.steps}]; "
                          "list steps this run reaches (or raise train.steps)")
    if config.tracking.wandb not in ("offline", "online", "disabled"):
        raise ConfigError(f"tracking.wandb={config.tracking.wandb!r}; use offline, online or disabled")
    if not config.tracking.job_type:
        raise ConfigError("tracking.job_type must not be empty; W&B groups runs by it (e.g. train, sweep)")


def _validate_model(config: Config) -> None:
    """Rules every family shares (shapes that tensor parallelism splits); the family's own
    `validate` checks its keys (families/__init__.py validate_for_family)."""
    model, tensor = config.model, config.parallel.tensor
    if model.head_dim is None and model.hidden_size % model.num_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={model.num_heads}; "
            f"use a head count from {_divisors(model.hidden_size)} or set model.head_dim"
        )
    if model.num_heads % tensor:
        raise ConfigError(
            f"parallel.tensor={tensor} does not divide model.num_heads={model.num_heads}; "
            f"use {_or_list(_divisors(model.num_heads))}"
        )
    if model.ffn_size % tensor:
        raise ConfigError(f"parallel.tensor={tensor} does not divide the FFN size {model.ffn_size}")
    if model.vocab_divisible_by % tensor:
        raise ConfigError(
            f"model.vocab_divisible_by={model.vocab_divisible_by} is not a multiple of parallel.tensor={tensor}; "
            "use a multiple such as 128"
        )


def _validate_numbers(section: Any, prefix: str) -> None:
    """Every numeric key of `section` and the sections and list items under it: within what its field
    declares (`bounded`), and finite if a float. A family's `model:` section and model.moe are walked
    as any other, so their fields declare their ranges the same way."""
    for declared in dataclasses.fields(section):
        value, key = getattr(section, declared.name), f"{prefix}{declared.name}"
        if dataclasses.is_dataclass(value):
            _validate_numbers(value, f"{key}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _validate_numbers(item, f"{key}[{index}].")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            allowed, finite = declared.metadata.get("allowed"), not isinstance(value, float) or math.isfinite(value)
            if allowed is not None and not (finite and allowed.holds(value)):
                raise ConfigError(allowed.refusal(key, value))
            if not finite:
                raise ConfigError(f"{key}={value} must be a finite number")


EVAL_ALL = "all"  # train.eval_samples: the whole validation split


def _validate_train(config: Config) -> None:
    train = config.train
    catchable = {"SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT"}
    unknown = [name for name in train.stop_signals if name not in catchable]
    if unknown:
        raise ConfigError(f"train.stop_signals has {unknown}; use names from {sorted(catchable)}")
    if any(batch < 1 for batch in train.spike.inject_at):
        raise ConfigError(f"train.spike.inject_at={train.spike.inject_at} must list global batches >= 1 (a test "
                          "fault injection; leave it empty to train normally)")
    if any(step < 1 for step in train.inject_nonfinite_loss_at):
        raise ConfigError(
            f"train.inject_nonfinite_loss_at={train.inject_nonfinite_loss_at} must list steps >= 1 (a test "
            "fault injection; leave it empty to train normally)"
        )
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr={train.min_lr} must be <= train.lr={train.lr} (the LR decays from lr "
                          "to min_lr)")
    _validate_recompute(train, config.model.num_layers)
    if train.init_from is not None and not train.init_from:
        raise ConfigError("train.init_from is empty; give the weights file `scaletrain import` wrote, or null")
    if train.init_from is not None and config.parallel.pipeline > 1:
        raise ConfigError("train.init_from loads into the unpipelined model; start with parallel.pipeline=1")
    if isinstance(train.eval_samples, str) and train.eval_samples != EVAL_ALL:
        raise ConfigError(f"train.eval_samples={train.eval_samples!r}; use a number of validation sequences (>= 1) "
                          f"or {EVAL_ALL} for the whole validation split")
    if train.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision={train.precision!r}; use auto, fp32 or bf16")
    if train.global_batch_size is not None and train.grad_accum != 1:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} and train.grad_accum={train.grad_accum} are both "
            "set; set one (grad_accum is derived from the global batch at launch)"
        )


def _validate_eval(config: Config) -> None:
    """In-loop downstream evaluation scores requests of every length with the training model as it is laid out, in
    any layout (evaluation/scoring.py); generation, which decodes one token per forward behind a KV cache, runs on
    a whole model or its tensor-parallel shard only, so under sequence or context parallelism and pipeline stages
    a generate_until task is refused when the tasks are found, before the first step (train/hooks/downstream.py).
    ZeRO-3 and expert parallelism are scored with every data-parallel rank running every forward."""
    evaluation = config.eval
    if any(not str(task).strip() for task in evaluation.tasks):
        raise ConfigError(f"eval.tasks={evaluation.tasks} has an empty entry; list lm-eval task names, task YAML "
                          "files or directories of them")


RECOMPUTE_MODES = ("none", "selective", "full", "auto")


def _validate_recompute(train: TrainConfig, num_layers: int) -> None:
    """The interval is full recomputation's chunk size, so it goes with full (or auto, which may pick full)."""
    if train.activation_checkpoint is not None and train.activation_checkpoint not in RECOMPUTE_MODES:
        raise ConfigError(f"train.activation_checkpoint={train.activation_checkpoint!r}; use "
                          f"{', '.join(RECOMPUTE_MODES[:-1])} or {RECOMPUTE_MODES[-1]}")
    interval = train.activation_checkpoint_interval
    if not 0 <= interval <= num_layers:
        raise ConfigError(f"train.activation_checkpoint_interval={interval} must be in [0, model.num_layers="
                          f"{num_layers}] (blocks per chunk under full recomputation; 0 for one)")
    if interval and train.activation_checkpoint in ("none", "selective"):
        raise ConfigError(
            f"train.activation_checkpoint={train.activation_checkpoint} with train.activation_checkpoint_interval="
            f"{interval}: the interval is the chunk size of full recomputation; set "
            f"train.activation_checkpoint_interval=0, or train.activation_checkpoint=full to recompute chunks of "
            f"{interval} blocks"
        )


def _validate_schedule(train: TrainConfig) -> None:
    """The LR schedule's keys; a branch's checkpoint is checked when the run starts (checkpoint/resume_policy.py)."""
    if train.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"train.lr_schedule={train.lr_schedule!r}; use {' or '.join(LR_SCHEDULES)}")
    if train.cooldown_shape not in COOLDOWN_SHAPES:
        raise ConfigError(f"train.cooldown_shape={train.cooldown_shape!r}; use {' or '.join(COOLDOWN_SHAPES)}")
    _validate_warmup(train)
    if train.branch_from is not None and not train.branch_from:
        raise ConfigError("train.branch_from is empty; give a checkpoint directory (RUN/checkpoints/step_NNNNNNNN) "
                          "or null")


def _validate_warmup(train: TrainConfig) -> None:
    """A warmup too long for the run is cut to fit (TrainConfig.resolved_warmup_steps, with a warning at
    load), except in a cooldown branch, whose warmup must be its stable run's: there it is refused."""
    if train.warmup_fraction is not None and train.warmup_steps:
        raise ConfigError(f"train.warmup_steps={train.warmup_steps} and train.warmup_fraction={train.warmup_fraction} "
                          "are both set; set one (an override of either replaces the other from the YAML file)")
    warmup = train.resolved_warmup_steps
    if train.branch_from and (warmup + train.cooldown_steps > train.steps or warmup >= train.steps):
        raise ConfigError(
            f"{_warmup_key(train)} plus the cooldown of {train.cooldown_steps} steps (train.cooldown_fraction="
            f"{train.cooldown_fraction} x train.steps={train.steps}) exceed train.steps; a cooldown branch "
            "(train.branch_from) keeps the warmup of the run it branches from, so it is not cut to fit: raise "
            "train.steps or lower train.cooldown_fraction"
        )


def _warmup_key(train: TrainConfig) -> str:
    """The key and value that set the warmup, as a message names it."""
    if train.warmup_fraction is None:
        return f"train.warmup_steps={train.warmup_steps}"
    return f"train.warmup_fraction={train.warmup_fraction} ({train.requested_warmup_steps} steps)"


def warn_if_warmup_cut(train: TrainConfig) -> None:
    """One warning line when the warmup asked for does not fit the run (a run shortened with
    train.steps=N): training goes on with the longest warmup that fits instead of stopping.
    For the training command to give, not for a saved config read back (config_loader's to_train)."""
    warmup = train.resolved_warmup_steps
    if warmup == train.requested_warmup_steps:
        return
    cooldown = f" with the WSD cooldown of {train.cooldown_steps} steps" if train.cooldown_steps else ""
    warnings.warn(ConfigWarning(
        f"{_warmup_key(train)} does not fit train.steps={train.steps}{cooldown}: warming up over {warmup} steps "
        "instead; set train.warmup_steps or train.warmup_fraction (e.g. 0.1) to choose"
    ), stacklevel=3)


def _validate_data(data: DataConfig) -> None:
    """The data keys' relations; the vocabulary's room is data/tokenizer.py's rule, a location's syntax
    data/storage.py's."""
    names = []
    for index, entry in enumerate(data.blend):
        if not entry.dir:
            raise ConfigError(f"data.blend[{index}].dir is empty; give the prepared dataset's directory or URL")
        names.append(entry.label)
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ConfigError(f"data.blend names {duplicated} more than one dataset; give each entry a distinct `name`")
    if data.tokenizer is not None and data.tokenizer_train_bytes is not None:
        raise ConfigError(f"data.tokenizer={data.tokenizer} reuses a tokenizer, so data.tokenizer_train_bytes="
                          f"{data.tokenizer_train_bytes} would train none; set one of them")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])
