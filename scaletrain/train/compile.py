"""torch.compile per transformer block (train.compile), as torchtitan's `apply_compile` does
(torchtitan/models/llama3/parallelize.py): each block is compiled on its own, so every block runs the
one graph the first compiled (the blocks differ only in their weights, which are the graph's inputs),
and inductor fuses what runs between the GEMMs: norms, the bias-add + activation, dropout, residual adds.

Each block is compiled in place (`nn.Module.compile`), not wrapped in an `OptimizedModule`: parameter
names, and so state dicts and checkpoints, are the same with and without compile (a wrapper would add
`_orig_mod.` to every name), and the parameters stay module attributes that dynamo reads at each call,
so FlatAdamW moving their storage into its flat buffers, or a checkpoint loading into them, is seen by
the compiled graph. Compilation itself waits for a block's first call, after the engine is built.

The rest of the model stays eager: embedding, output layer and loss (the vocab-parallel cross-entropy,
and the chunked one, are megatron's autograd functions), the masks the block runners build, and
recomputation, which wraps compiled blocks (full: torch's checkpoint around a chunk of them; DeepSpeed's
in pipeline stages) or is traced inside them (selective: the attention core's checkpoint). Generation
builds its own model and runs eagerly.
"""

from __future__ import annotations

from torch import nn

from scaletrain import upstream
from scaletrain.config import Config
from scaletrain.model.moe import MoELayer


def compile_blocks(model: nn.Module, config: Config) -> bool:
    """Compile each transformer block of `model` (a LayeredModel or a pipeline stage: their
    `block_modules()`) in place; returns whether as whole graphs.

    Whole graphs (`fullgraph=True`, as torchtitan) where a block runs no collective: megatron's
    tensor-parallel linears all-reduce asynchronously in backward, ring attention sends and receives,
    and the experts' routing has data-dependent shapes, all of which dynamo leaves to eager code (a
    graph break). So with parallel.tensor > 1, parallel.context > 1 or MoE layers a block is compiled
    in pieces between those calls, which are exact as eager: the results are the same, the fusions fewer.
    """
    upstream.let_dynamo_trace_megatron_linears()
    has_experts = any(isinstance(module, MoELayer) for module in model.modules())
    fullgraph = config.parallel.tensor == 1 and config.parallel.context == 1 and not has_experts
    for block in model.block_modules():
        block.compile(fullgraph=fullgraph)
    return fullgraph
