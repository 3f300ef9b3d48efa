"""Model families built on megatron-core tensor-parallel primitives."""

from __future__ import annotations

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from scaletrain.config import Config
from scaletrain.model.bert import BERT
from scaletrain.model.gpt import GPT
from scaletrain.model.t5 import T5, T5Architecture


def model_parallel_config(config: Config) -> ModelParallelConfig:
    """CPU initialisation always: it builds each full master weight, which is what makes the
    initial model identical in every layout (see model/init.py)."""
    return ModelParallelConfig(
        tensor_model_parallel_size=config.parallel.tensor,
        pipeline_model_parallel_size=config.parallel.pipeline,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32 if config.parallel.pipeline > 1 else None,
    )


def build_model(config: Config) -> nn.Module:
    """The config's family; its forward takes the objective's batch keys as keyword arguments."""
    model, mp_config, seed = config.model, model_parallel_config(config), config.train.seed
    if model.family == "bert":
        return BERT(
            model, config.padded_vocab_size, mp_config, seed,
            type_vocab_size=model.type_vocab_size,
            layernorm_position=model.layernorm_position or "post",
            sentence_order_head=config.objective.sentence_pairs != "none",
            checkpoint_interval=config.train.activation_checkpoint_interval,
        )
    if model.family == "t5":
        return T5(t5_architecture(config), mp_config, seed)
    return GPT(
        model,
        vocab_size=config.padded_vocab_size,
        mp_config=mp_config,
        seed=seed,
        checkpoint_interval=config.train.activation_checkpoint_interval,
    )


def t5_architecture(config: Config) -> T5Architecture:
    model = config.model
    return T5Architecture(
        vocab_size=config.padded_vocab_size,
        hidden_size=model.hidden_size,
        num_heads=model.num_heads,
        head_dim=model.attention_head_dim,
        ffn_hidden_size=model.ffn_size,
        num_encoder_layers=model.num_layers,
        num_decoder_layers=model.num_decoder_layers or model.num_layers,
        ffn_activation=model.ffn_activation,
        tie_embeddings=model.tie_embeddings,
        relative_attention_num_buckets=model.relative_attention_num_buckets,
        relative_attention_max_distance=model.relative_attention_max_distance,
        layernorm_eps=model.layernorm_eps,
        dropout=model.dropout,
    )
