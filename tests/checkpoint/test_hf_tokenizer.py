"""An export's tokenizer as Hugging Face tools load it: `AutoTokenizer.from_pretrained(export)` encodes
and decodes exactly as our `Tokenizer` for every family, and HF's greedy `generate` on an exported GPT
continues a prompt with our model's tokens.

Without the files checkpoint/hf/tokenizer.py writes, AutoTokenizer loads a GPT export's tokenizer.model as a
GPT2Tokenizer whose ids are not ours and which decodes "▁ROMEO:<0x0A>But▁soft" (issue 21).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import transformers
from transformers import AutoTokenizer

from scaletrain.checkpoint.hf.tokenizer import FIRST_LEARNED_ID, write_hf_tokenizer
from scaletrain.data.tokenizer import SPECIAL_IDS, Tokenizer
from scaletrain.families import get_family
from tests.distributed.harness import run_on_ranks
from tests.train.runs import DEMO_CONFIG, run_scaletrain, tiny_overrides

FAMILIES = ("gpt", "llama", "bert", "t5")
MODEL_MAX_LENGTH = 64
TEXTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "\n\n\nTwo blank lines above, one below\n\n",
    "runs  of   spaces    and\ttabs\t\t",
    " a leading space", "   three leading spaces", "trailing spaces   ", " ", "",
    "Act 1, Scene 2: 1599 or 1600? 3.14159, 42nd, 007",
    "Punctuation!?;:'\"()[]{}<>@#$%^&*-_=+/\\|~`",
    "Accents: café, naïve, Ångström, façade, Zoë",
    "CJK: 日本語のテキスト, 中文文本, 한국어",
    "Emoji by byte fallback: 😀 👍🏽 🎭",
    "Symbols written out: [MASK] and [CLS] x [SEP]", "[MASK]", "[CLS]to be[SEP]", "a[MASK]b [MASK] ",
    "Specials and sentinels spelled out: <s> </s> <pad> <unk> <extra_id_0> <extra_id_15>",
]


@pytest.fixture(scope="module")
def ours(small_dataset: Path) -> Tokenizer:
    return Tokenizer.load(small_dataset)


def _export_like_dir(small_dataset: Path, family: str, out_dir: Path) -> Path:
    """What `scaletrain export` leaves beside the weights: the family's HF config.json (AutoTokenizer
    reads its model type), our tokenizer files, and the Hugging Face ones made from them."""
    model_class = getattr(transformers, get_family(family).hf.model_class)
    model_class.config_class().save_pretrained(out_dir)
    for name in ("tokenizer.model", "tokenizer.layout.json"):
        shutil.copy(small_dataset / name, out_dir / name)
    write_hf_tokenizer(out_dir / "tokenizer.model", get_family(family), MODEL_MAX_LENGTH, out_dir)
    return out_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_autotokenizer_encodes_and_decodes_as_ours(family, small_dataset, ours, tmp_path):
    hf = AutoTokenizer.from_pretrained(_export_like_dir(small_dataset, family, tmp_path))
    assert isinstance(hf, transformers.PreTrainedTokenizerFast) and hf.model_max_length == MODEL_MAX_LENGTH
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf(text, add_special_tokens=False).input_ids == ids, text
        assert hf.decode(ids) == ours.decode(ids) == text
    names = {"pad": hf.pad_token_id, "unk": hf.unk_token_id, "bos": hf.bos_token_id, "eos": hf.eos_token_id,
             "mask": hf.mask_token_id, "cls": hf.cls_token_id, "sep": hf.sep_token_id}
    assert names == {"pad": 0, "unk": 1, "bos": 2, "eos": 3, "mask": 4, "cls": 5, "sep": 6}
    sentinels = [f"<extra_id_{i}>" for i in range(ours.num_sentinels)]
    assert hf.convert_tokens_to_ids(sentinels) == [ours.sentinel_id(i) for i in range(ours.num_sentinels)]
    assert len(hf) == ours.vocab_size


@pytest.mark.parametrize("family", FAMILIES)
def test_sentinels_decode_as_ours_and_encoding_frames_text_as_the_family_trains(family, small_dataset, ours,
                                                                               tmp_path):
    hf = AutoTokenizer.from_pretrained(_export_like_dir(small_dataset, family, tmp_path))
    first, second = ours.sentinel_id(0), ours.sentinel_id(1)
    for ids in ([first, *ours.encode("cat"), second, *ours.encode(" sat"), ours.sentinel_id(15)],
                [*ours.encode("The"), first, *ours.encode(" on  the"), second, first, *ours.encode("\nmat")]):
        assert hf.decode(ids) == ours.decode(ids)
    text, ids = "Is this a dagger", ours.encode("Is this a dagger")
    framed = {"gpt": [3, *ids], "llama": [3, *ids], "t5": [*ids, 3], "bert": [5, *ids, 6]}[family]
    assert hf(text).input_ids == framed
    assert hf.decode(framed, skip_special_tokens=True) == text
    if family == "bert":
        pair = hf(text, "which I see")
        assert pair.input_ids == [5, *ids, 6, *ours.encode("which I see"), 6]
        assert pair.token_type_ids == [0] * (len(ids) + 2) + [1] * (len(pair.input_ids) - len(ids) - 2)
    else:  # GPT-2 would add the embedding of token_type_ids to its input
        assert "token_type_ids" not in hf(text)


def test_every_piece_and_the_corpus_encode_as_ours(small_dataset, small_dataset_raw, ours, tmp_path):
    """Each learned piece as a whole text and right after [MASK] (where a piece is looked up whole), and
    every 7-line chunk of the works the tokenizer learned from."""
    hf = AutoTokenizer.from_pretrained(_export_like_dir(small_dataset, "gpt", tmp_path))
    processor = spm.SentencePieceProcessor(model_file=str(small_dataset / "tokenizer.model"))
    pieces = [processor.id_to_piece(i).replace("▁", " ") for i in range(FIRST_LEARNED_ID, processor.get_piece_size())]
    lines = [line for path in small_dataset_raw for line in path.read_text().split("\n")]
    chunks = ["\n".join(lines[start:start + 7]) for start in range(0, len(lines), 7)]
    texts = [*pieces, *(piece[1:] for piece in pieces), *("[MASK]" + piece for piece in pieces), *chunks]
    assert hf(texts, add_special_tokens=False).input_ids == ours.encode_batch(texts, num_threads=1)
    ids = ours.encode(chunks[0])
    assert hf.decode(ids) == ours.decode(ids)


def _greedy_continuation(rank: int, world_size: int, run_dir: Path, prompt_ids: list[int],
                         new_tokens: int) -> list[int]:
    from megatron.core import parallel_state

    from scaletrain.checkpoint.format import latest_checkpoint
    from scaletrain.config_loader import load_config
    from scaletrain.generate import load_model
    from scaletrain.model.sampling import sample_tokens
    from scaletrain.run_config import single_process_config

    parallel_state.initialize_model_parallel()
    checkpoint = latest_checkpoint(run_dir)
    config = single_process_config(load_config(checkpoint / "config.yaml"))
    model = load_model(config, checkpoint)
    return sample_tokens(model, prompt_ids, new_tokens, config.model.seq_length, config.data.vocab_size, 0.0,
                         None, torch.Generator(), stop_token=SPECIAL_IDS["eos"])


@pytest.mark.slow
def test_gpt_export_carries_its_tokenizer_and_generates_as_we_do(small_dataset, ours, tmp_path):
    """Four steps leave a model that mostly continues with newlines: what this checks is that HF's tokenizer
    frames the prompt as `scaletrain generate` does and that HF's greedy tokens are our model's."""
    run_dir, hf_dir = tmp_path / "run", tmp_path / "hf"
    run_scaletrain("train", [str(DEMO_CONFIG), *tiny_overrides(small_dataset, run_dir), "train.steps=4"])
    run_scaletrain("export", [str(run_dir), str(hf_dir)])

    umask = os.umask(0)
    os.umask(umask)
    expected = {"config.json", "model.safetensors", "tokenizer.model", "tokenizer.layout.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json"}
    assert expected <= {path.name for path in hf_dir.iterdir()}
    assert {path.name: path.stat().st_mode & 0o777 for path in hf_dir.iterdir()} == {
        path.name: 0o666 & ~umask for path in hf_dir.iterdir()}  # model.safetensors was 0600
    assert hf_dir.stat().st_mode & 0o777 == 0o777 & ~umask

    hf = AutoTokenizer.from_pretrained(hf_dir)
    prompt = "ROMEO:\nBut soft, what light"
    inputs = hf(prompt, return_tensors="pt")
    prompt_ids = [ours.eos_id, *ours.encode(prompt)]
    assert inputs.input_ids[0].tolist() == prompt_ids
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    theirs = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=hf.pad_token_id)
    theirs = theirs[0, len(prompt_ids):].tolist()
    assert theirs == run_on_ranks(_greedy_continuation, 1, run_dir, prompt_ids, 8)[0]
    assert hf.decode(theirs, skip_special_tokens=True) == ours.decode(theirs)
