"""scaletrain: pretraining GPT, BERT and T5 with megatron-core tensor parallelism and DeepSpeed."""

__version__ = "0.1.0"
