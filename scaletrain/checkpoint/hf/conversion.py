"""What every family's Hugging Face conversion shares: the state dict it reads, name-by-name taking, fp32.

Input and output are state dicts in scaletrain's parameter names at TP=1: `consolidated_state_dict`
of a training checkpoint, or live shards joined with `merge_shards`; `split_for_rank` shards an
imported one again. The HF model keeps our *padded* vocabulary (config.vocab_size = padded size):
the padding rows take part in our softmax, so keeping them makes HF's probabilities ours exactly;
the tokenizer never emits their ids. Weights are fp32, as our master weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # an annotation only: the T5 conversion writes its files without transformers
    from transformers import PreTrainedModel

StateDict = dict[str, torch.Tensor]

# Names ending so are megatron's per-layer metadata (always None on our layers), not weights.
EXTRA_STATE_SUFFIX = "_extra_state"


def weights_only(state: StateDict) -> StateDict:
    """`state` without megatron's `_extra_state` entries, which no HF model has."""
    return {name: tensor for name, tensor in state.items() if not name.endswith(EXTRA_STATE_SUFFIX)}


def check_vocabulary_rows(weights: StateDict, word_embedding: str, vocab_size: int) -> None:
    """A TP shard or an unpadded vocabulary would export a model whose ids are not ours: refuse it."""
    rows = weights[word_embedding].shape[0] if word_embedding in weights else 0
    if rows != vocab_size:
        raise ValueError(
            f"the state dict's {word_embedding} has {rows} rows but vocab_size={vocab_size}; pass the "
            "padded vocabulary size and a full TP=1 state dict (merge shards with consolidated_state_dict)"
        )


def take(weights: StateDict, name: str, family: str, keep: bool = False) -> torch.Tensor:
    """Remove and return `name`, so check_all_taken can tell whether every weight was converted."""
    if name not in weights:
        raise ValueError(f"the state dict has no weight {name}; is it a full state dict of a {family} model?")
    return weights[name] if keep else weights.pop(name)


def check_all_taken(weights: StateDict, family: str) -> None:
    """What `take` left behind are weights the family's HF model has no place for."""
    if weights:
        raise ValueError(f"the state dict has weights a {family} model does not: {sorted(weights)}")


def hf_model(model_class: type[PreTrainedModel], hf_config: object, hf_state: StateDict) -> PreTrainedModel:
    """`model_class` holding exactly `hf_state` (strict: a missing or extra HF weight is an error)."""
    model = model_class(hf_config)
    model.load_state_dict({name: tensor.contiguous() for name, tensor in hf_state.items()}, strict=True)
    return model.eval()


def fp32(tensor: torch.Tensor) -> torch.Tensor:
    """An fp32 copy that owns its memory, so the imported state outlives the HF model it came from."""
    return tensor.detach().to(torch.float32).contiguous().clone()
