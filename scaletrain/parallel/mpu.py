"""The `mpu` object DeepSpeed asks for, answered by megatron-core's `parallel_state`.

DeepSpeed calls the tensor-parallel group its "model parallel" group: it uses it to count
replicated parameters once in the gradient norm and to place ZeRO partitions per TP rank.

Its "data parallel" group is megatron's data-parallel group with the context-parallel ranks (the same
group when parallel.context is 1): context-parallel ranks hold the same weights, each with the gradient
of its chunks of the sequence, so DeepSpeed averages (and ZeRO partitions) over DP x CP, as Megatron's
optimizer does. Each rank's loss is scaled so that average is the exact mean over tokens
(parallel/context_parallel.py context_parallel_token_mean).
"""

from functools import partial

from megatron.core import parallel_state


class MegatronMPU:
    """Exposes megatron's process groups under the names DeepSpeed's engine looks up."""

    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(partial(parallel_state.get_data_parallel_rank, with_context_parallel=True))
    get_data_parallel_world_size = staticmethod(
        partial(parallel_state.get_data_parallel_world_size, with_context_parallel=True))
    get_data_parallel_group = staticmethod(partial(parallel_state.get_data_parallel_group, with_context_parallel=True))
