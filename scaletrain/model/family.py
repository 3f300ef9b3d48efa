"""What a model family is to the rest of scaletrain: one registered `ModelFamily` spec.

A family's folder (families/<name>/) holds its typed config section, validation and model
(model.py), its Hugging Face adapter (hf.py) and this spec (__init__.py); families/__init__.py finds
the folder by the name. The trainer, pipeline, planner, exporter and generator ask the spec instead
of branching on the name (the pattern of torchtitan's `ModelSpec`).

The model itself is an ordered list of `PipelineLayer`s: each builds the modules at one place in
the model (so its parameters carry the model's names) and maps a tuple of activations to the next.
`LayeredModel` runs them in order on one device; model/pipeline.py hands the same layers to
DeepSpeed's pipeline engine, which builds only a stage's own. There is no second definition of a
model, and checkpoints from any layout hold the same parameter names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaletrain.batch import Batch, BatchSchema
from scaletrain.config import ConfigError
from scaletrain.model.layers import recompute_attention_cores, run_in_chunks

if TYPE_CHECKING:
    from scaletrain.config import Config, ModelConfig, TrainConfig
    from scaletrain.data.objectives import Collator, TokenizerInfo
    from scaletrain.model.counts import ModelCounts

Activations = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PipelineLayer:
    """One unit pipeline stages are cut from.

    `build()` returns the module found at `name` in the model ("" puts its children at the top
    level); `run(module, activations, **context)` is the layer's forward on a tuple of tensors
    (context carries what only single-device inference passes, e.g. a KV cache). A layer with
    `tied_to` reuses the module of that earlier layer (a tied output embedding): DeepSpeed keeps a
    copy on the last stage and all-reduces the gradient of `tied_weight` between the copies.
    `tied_weight` may name several weights: a whole block reused by several layers (ALBERT's
    cross-layer sharing) ties every one of its parameters.
    """

    name: str
    build: Callable[[], nn.Module]
    run: Callable[..., Activations]
    is_block: bool = False
    tied_to: str | None = None
    tied_weight: str | tuple[str, ...] = ""

    @property
    def tied_weights(self) -> tuple[str, ...]:
        return (self.tied_weight,) if isinstance(self.tied_weight, str) else self.tied_weight


@dataclass(frozen=True)
class HFAdapter:
    """Export to / import from a Hugging Face `transformers` model class; each family's is the
    `ADAPTER` of its folder's hf.py (families/<name>/hf.py), which its `ModelFamily.hf` names."""

    model_class: str  # e.g. "LlamaForCausalLM", for messages and docs
    export: Callable[[dict[str, torch.Tensor], Config, Any], None]  # (TP=1 state, config, out_dir)
    import_: Callable[[Any], dict[str, torch.Tensor]]  # hf_dir -> TP=1 state in our names
    # What training put around one text and around a pair, as `tokenizers` templates ($A, $B, special
    # tokens by name), so the exported tokenizer adds the same (checkpoint/hf/tokenizer.py).
    text_framing: tuple[str, str]
    token_types: bool = False  # the model reads token_type_ids (BERT's segments)
    # Subdirectories of an export that each hold one model (and so a copy of the tokenizer): "" is
    # the export directory itself; ELECTRA writes its generator and discriminator side by side.
    model_dirs: tuple[str, ...] = ("",)


@dataclass(frozen=True)
class TrainingObjective:
    """One objective a spec names (`ModelFamily.objectives`): how its collator is built from the config. The ones
    families share are train/objective.py's (causal_lm, prefix_lm, mlm); one that only a family trains lives in
    its folder, beside its collator, and its spec lists it in `own_objectives`."""

    name: str
    # (config, tokenizer facts, family) -> the collator; every collator exposes packed_seq_length
    collator: Callable[[Config, TokenizerInfo, ModelFamily], Collator]


@dataclass(frozen=True)
class ModelFamily:
    """Everything the rest of the code needs to know about one family."""

    name: str
    config_class: type[ModelConfig]  # its typed `model:` section
    build: Callable[[Config], nn.Module]  # the model on this process's TP rank
    pipeline_layers: Callable[[Config], list[PipelineLayer]]
    loss: Callable[[Activations, tuple[torch.Tensor, ...]], torch.Tensor]  # last layer's output, labels
    # the objectives it trains, by name (the shared ones of train/objective.py and its own); the first is the default
    objectives: tuple[str, ...]
    batch_schema: Callable[[Config], BatchSchema]
    counts: Callable[[Config], ModelCounts]  # exact parameters and FLOPs (planner, MFU, sweeps)
    validate: Callable[[Config], None] = lambda config: None
    hf: HFAdapter | None = None  # its hf.py's; transformers is imported only when it converts
    # Extra validation metrics as (numerator, denominator) counts, summed over batches and ranks.
    evaluation_counts: Callable[[nn.Module, Batch], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None
    # Metric values from those counts, each [numerator, denominator, ...] summed over batches and ranks;
    # None: numerator / denominator. For a metric that is no ratio of sums (ELECTRA's AUC from histograms).
    evaluation_values: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None
    # The same counts from what a pipeline's last stage holds: the last layer's outputs and the labels
    # (as `loss` gets them); required with evaluation_counts if the family trains in pipeline stages.
    pipeline_evaluation_counts: Callable[[Activations, tuple[torch.Tensor, ...]],
                                         dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None
    encoder_decoder: bool = False  # inputs go to an encoder and targets to a decoder (T5)
    generation: str | None = None  # a registered generation (generate.py GENERATIONS); None: cannot generate
    not_generating_reason: str = ""
    pipeline_objectives: tuple[str, ...] = field(default=())  # objectives a pipelined run may train
    own_objectives: tuple[TrainingObjective, ...] = ()  # the objectives no other family trains (its folder's)
    sequence_parallel: bool = False  # whether its layers implement parallel.sequence_parallel
    context_parallel: bool = False  # whether its layers implement parallel.context (ring attention)


class LayeredModel(nn.Module):
    """A family's model on one device: its pipeline layers, run in order.

    Layers are installed at their names (`blocks.3` goes to `self.blocks[3]`), so parameter names
    are the model's own; a tied layer runs the module of the layer it is tied to.
    """

    def __init__(self, layers: list[PipelineLayer], checkpoint_interval: int = 0) -> None:
        super().__init__()
        self.checkpoint_interval = checkpoint_interval
        modules: dict[str, nn.Module] = {}
        self._borrowed: list[nn.Parameter] = []
        for layer in layers:
            if layer.tied_to is None:
                modules[layer.name] = layer.build()  # runs as built; its parameters live at layer.name
                if install(self, layer.name, modules[layer.name]) is not modules[layer.name]:
                    # merged into a module already there (BERT's decoder bias into lm_head): the
                    # built module is not in the tree, so no forward hook sees its own parameters
                    self._borrowed += list(modules[layer.name].parameters(recurse=False))
            else:
                tied = [modules[layer.tied_to].get_parameter(name) for name in layer.tied_weights]
                self._borrowed += [weight for weight in tied if not any(weight is seen for seen in self._borrowed)]
        # A plain list: the modules are already registered at their names.
        self._layers = [(layer, modules[layer.tied_to or layer.name]) for layer in layers]

    def run_layers(self, activations: Activations, until: str | None = None, **context: Any) -> Activations:
        """Activations after every layer (or up to, not including, the first layer named `until`).
        Consecutive blocks are recomputed in chunks of checkpoint_interval while training."""
        interval = self.checkpoint_interval if self.training else 0
        pending: list[tuple[PipelineLayer, nn.Module]] = []
        for layer, module in self._layers:
            if layer.name == until:
                break
            if layer.is_block and interval:
                pending.append((layer, module))
                continue
            activations = _run_chunked(pending, activations, interval)
            pending = []
            activations = layer.run(module, activations, **context)
        return _run_chunked(pending, activations, interval)

    def block_modules(self) -> list[nn.Module]:
        """The modules of the block layers, each once (ALBERT's shared block serves every layer)."""
        return _distinct([module for layer, module in self._layers if layer.is_block])

    def borrowed_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs where a module uses a weight no called submodule owns: a tied
        output layer's, or one merged into another module's place, both used in this model's
        forward. ZeRO-3 must gather them for it."""
        return [(self, parameter) for parameter in self._borrowed]


def apply_recompute(module: nn.Module, train: TrainConfig) -> nn.Module:
    """train.activation_checkpoint on a built model or pipeline stage, returned. Full recomputation is the
    chunked run of blocks the family passes its model (train.full_recompute_interval; DeepSpeed's
    PipelineModule in stages); selective marks every attention core to be recomputed
    (layers.ParallelAttention); auto is decided for the device when a run starts (planner/recompute.py)."""
    if train.recompute == "auto":
        raise ConfigError("train.activation_checkpoint=auto is decided from the GPU's memory when a run starts "
                          "(planner/recompute.py resolve_recompute); resolve it before building the model, or set "
                          "train.activation_checkpoint to none, selective or full")
    marked = recompute_attention_cores(module) if train.recompute == "selective" else None
    # a whole model without one has an attention of another kind (a pipeline stage may hold no block)
    if marked == 0 and isinstance(module, LayeredModel):
        raise ConfigError("train.activation_checkpoint=selective recomputes the attention cores of the shared "
                          "ParallelAttention, and this model has none; use train.activation_checkpoint=full or none")
    return module


def _distinct(modules: list[nn.Module]) -> list[nn.Module]:
    return list({id(module): module for module in modules}.values())


def _run_chunked(
    pending: list[tuple[PipelineLayer, nn.Module]], activations: Activations, interval: int
) -> Activations:
    if not pending:
        return activations
    steps = [(lambda acts, layer=layer, module=module: layer.run(module, acts)) for layer, module in pending]
    return run_in_chunks(steps, activations, interval)


def install(root: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Register `module` at dotted path `name` under root, creating containers on the way
    (a numeric part is a ModuleList index). "" merges module's children and parameters into root;
    an existing path gets the new module's parameters and children added. Returns the module now at
    the path."""
    if not name:
        target = root
    else:
        *parents, leaf = name.split(".")
        parent = root
        for part, after in zip(parents, [*parents[1:], leaf][:len(parents)], strict=True):
            parent = _child(parent, part, numeric_next=after.isdigit())
        existing = _get(parent, leaf)
        if existing is None:
            _set(parent, leaf, module)
            return module
        target = existing
    for child_name, child in module.named_children():
        target.add_module(child_name, child)
    for param_name, param in module.named_parameters(recurse=False):
        target.register_parameter(param_name, param)
    return target


def _child(parent: nn.Module, part: str, numeric_next: bool) -> nn.Module:
    existing = _get(parent, part)
    if existing is None:
        existing = nn.ModuleList() if numeric_next else nn.Module()
        _set(parent, part, existing)
    return existing


def _get(parent: nn.Module, part: str) -> nn.Module | None:
    return parent._modules.get(part)


def _set(parent: nn.Module, part: str, module: nn.Module) -> None:
    """By name, also in a ModuleList: a pipeline stage holds blocks 4..7 only, under those indices."""
    parent.add_module(part, module)
