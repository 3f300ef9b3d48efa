"""The `mpu` object DeepSpeed asks for, answered by megatron-core's `parallel_state`.

DeepSpeed calls the tensor-parallel group its "model parallel" group: it uses it to count
replicated parameters once in the gradient norm and to place ZeRO partitions per TP rank.
"""

from megatron.core import parallel_state


class MegatronMPU:
    """Exposes megatron's process groups under the names DeepSpeed's engine looks up."""

    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
