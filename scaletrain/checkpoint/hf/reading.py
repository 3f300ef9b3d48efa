"""Reading a Hugging Face model directory for `scaletrain import`, checked: each family's adapter loads
its model through `load_checked`, which refuses in one line, naming the file and the key or tensor,
what `from_pretrained` would let through or meet with a traceback.

from_pretrained random-initialises a tensor the files lack (a directory without config.json even
takes GPT-2 small's sizes), drops a tensor of a layer its config.json does not count, casts an integer
tensor into a float weight and loads NaN as any value; a negative layer count, a size written as a
string or a truncated safetensors file end in a traceback instead. Here the sizes in config.json are
checked first, then every weight file's header, then what the loaded model got: nothing missing,
misshapen or left over from a layer, no integer weight, every value finite.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open

from scaletrain.checkpoint.integrity import nonfinite_tensors
from scaletrain.checkpoint.safe_load import load_tensors

if TYPE_CHECKING:  # the model classes come from the adapters, which import transformers
    from transformers import PreTrainedModel

# config.json keys that count or size something, in every family's HF config: a whole number >= 1
# where set. Zero or a negative count builds a model with no layers, heads or rows, which then loads
# none of the file's weights for them.
SIZE_KEYS = (
    "vocab_size", "type_vocab_size", "max_position_embeddings", "n_positions", "n_embd", "n_layer", "n_head",
    "n_inner", "hidden_size", "embedding_size", "num_hidden_layers", "num_hidden_groups", "inner_group_num",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "d_model", "d_kv", "d_ff",
    "num_layers", "num_decoder_layers", "num_heads", "relative_attention_num_buckets",
    "relative_attention_max_distance", "encoder_layers", "decoder_layers", "encoder_attention_heads",
    "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "num_local_experts", "num_experts_per_tok",
    "sliding_window",
)
# (the index of a sharded checkpoint, the single file), in the order transformers prefers them
WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json",
                                                                        "pytorch_model.bin"))
REFETCH = "download it again, or save the model again with save_pretrained"


def load_checked(model_class: type[PreTrainedModel], hf_dir: str | Path) -> PreTrainedModel:
    """`model_class.from_pretrained(hf_dir)`, every weight of it read from the files, checked."""
    hf_dir = Path(hf_dir)
    read_hf_config(hf_dir)
    stored = stored_tensors(hf_dir)
    try:
        with _transformers_quiet():
            model, loading = model_class.from_pretrained(hf_dir, output_loading_info=True,
                                                         ignore_mismatched_sizes=True)
    except (StrictDataclassError, ValueError, TypeError) as error:
        raise ValueError(f"{hf_dir / 'config.json'} does not make a {model_class.__name__}: "
                         f"{_first_line(error)}") from None
    _check_loading(hf_dir, model, loading)
    _check_dtypes(hf_dir, model, stored)
    check_finite(hf_dir, model.state_dict().items())
    return model.eval()


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """config.json as a mapping whose sizes (SIZE_KEYS) are whole numbers >= 1 where set."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file} does not exist; a Hugging Face model directory holds config.json beside "
                         f"its weights ({REFETCH})")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}); {REFETCH}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} holds a {type(config).__name__}, not a mapping of settings; {REFETCH}")
    for key in SIZE_KEYS:
        value = config.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{config_file} has {key}={value!r}; it must be a whole number >= 1 (or null where "
                             "the model allows it)")
    return config


def stored_tensors(hf_dir: Path) -> dict[str, tuple[str, bool]]:
    """Every tensor the weight files hold, by name: (its dtype, whether floating point); read from the
    safetensors headers (a pytorch_model.bin is unpickled, restricted), so a damaged file is refused here."""
    stored = {}
    for weight_file in _weight_files(hf_dir):
        if weight_file.suffix == ".safetensors":
            try:
                with safe_open(weight_file, framework="pt") as reader:
                    for name in reader.keys():  # noqa: SIM118 (a safetensors reader is not a mapping)
                        dtype = reader.get_slice(name).get_dtype()
                        stored[name] = (dtype, dtype.startswith(("F", "BF")))
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{weight_file} is not a readable safetensors file ({_first_line(error)}); "
                                 f"{REFETCH}") from None
        else:
            try:
                state = load_tensors(weight_file)
            except (RuntimeError, EOFError, KeyError) as error:
                raise ValueError(f"{weight_file} is not a readable PyTorch weights file ({_first_line(error)}); "
                                 f"{REFETCH}") from None
            stored |= {name: (str(tensor.dtype), tensor.is_floating_point()) for name, tensor in state.items()}
    return stored


def check_finite(hf_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    nonfinite = nonfinite_tensors(tensors)
    if nonfinite:
        raise ValueError(f"{hf_dir} holds non-finite values: {nonfinite}; a run started from them would train on "
                         "NaN. Import a checkpoint whose weights are finite")


def _weight_files(hf_dir: Path) -> list[Path]:
    for index_name, single_name in WEIGHT_FILES:
        index = hf_dir / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(f"{index} is not an index of weight files ({type(error).__name__}: {error}); "
                                 f"{REFETCH}") from None
            absent = [shard for shard in shards if not (hf_dir / shard).is_file()]
            if absent:
                raise ValueError(f"{hf_dir} has no {absent[0]}, which {index.name} lists; {REFETCH}")
            return [hf_dir / shard for shard in shards]
        if (hf_dir / single_name).is_file():
            return [hf_dir / single_name]
    raise ValueError(f"{hf_dir} holds no model.safetensors or pytorch_model.bin (nor an index of their shards); "
                     f"{REFETCH}")


def _check_loading(hf_dir: Path, model: PreTrainedModel, loading: dict[str, Any]) -> None:
    """What from_pretrained reports: a tensor missing or of another shape, or one more of a numbered
    part than config.json counts (a layer, an expert). A left-over tensor of a part the class does
    not have (BERT's next-sentence head read as BertForMaskedLM) is dropped, as transformers does."""
    name = type(model).__name__
    missing = sorted(loading["missing_keys"])
    if missing:
        raise ValueError(f"{hf_dir} has no tensor {missing[0]}{_more(missing)}, which a {name} with its config.json "
                         f"needs; the checkpoint is incomplete: {REFETCH}")
    mismatched = sorted(loading["mismatched_keys"])
    if mismatched:
        tensor, stored_shape, expected_shape = mismatched[0]
        raise ValueError(f"{hf_dir}'s {tensor} has shape {list(stored_shape)}, but its config.json makes it "
                         f"{list(expected_shape)}; the weights and config.json are of different models")
    expected = {_numbered(parameter) for parameter, _ in model.state_dict().items()}
    surplus = sorted(tensor for tensor in loading["unexpected_keys"] if _numbered(tensor) in expected
                     or _numbered(f"{model.base_model_prefix}.{tensor}") in expected)
    if surplus:
        raise ValueError(f"{hf_dir} holds {surplus[0]}{_more(surplus)}, of more layers (or experts) than its "
                         f"config.json counts; the weights and config.json are of different models")


def _check_dtypes(hf_dir: Path, model: PreTrainedModel, stored: dict[str, tuple[str, bool]]) -> None:
    """A weight stored as integers would be cast into its float parameter without a word."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    prefix = f"{model.base_model_prefix}."
    integer = sorted(name for name, (_, floating) in stored.items()
                     if not floating and (name in parameters or prefix + name in parameters))
    if integer:
        raise ValueError(f"{hf_dir} stores {integer[0]} as {stored[integer[0]][0]}{_more(integer)}; model weights "
                         f"are floating point: {REFETCH}")


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """Without from_pretrained's loading report and progress bar: what the report says of missing,
    misshapen and left-over tensors is checked here and refused in one line instead."""
    from transformers.utils import logging as transformers_logging  # here: exporting T5 needs no transformers

    verbosity, progress_bar = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if progress_bar:
            transformers_logging.enable_progress_bar()


def _numbered(name: str) -> str:
    """The name with its indices as #: transformer.h.#.ln_1.weight, for the parts a config counts."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "#", name)


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
