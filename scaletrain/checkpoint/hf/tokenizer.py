"""Hugging Face tokenizer files for an export, so that `AutoTokenizer.from_pretrained(out_dir)` gives our ids.

Without them transformers falls back on the model type's class (a GPT2Tokenizer for a GPT export),
whose ids have nothing to do with our sentencepiece model's, and says nothing.

Fast, not slow: transformers >= 5 always builds a `tokenizers` backend (AutoTokenizer ignores
`use_fast`; LlamaTokenizer and T5Tokenizer are `tokenizers` pipelines, T5's a Unigram model, which ours
is not), and its sentencepiece-backed classes decode byte pieces as the text "<0x0A>" and strip spaces.
Measured against `Tokenizer` on a handful of texts: LlamaTokenizer converted from tokenizer.model
(legacy or not) differs on leading spaces, a symbol at the start and literal "<s>"; the generic
conversion of tokenizer.model matches "<s>" in text and knows no sentinels or [MASK]/[CLS]/[SEP] names.
So we write the pipeline ourselves into tokenizer.json, loaded as it is by the generic
`PreTrainedTokenizerFast` (TokenizersBackend in transformers 5):
  - model: BPE over our pieces at our ids, with byte fallback. sentencepiece BPE joins the adjacent pair
    whose concatenation is the best-scored piece (bpe_model.cc); `tokenizers` joins the pair of lowest
    merge rank, so every split of every piece into two pieces is a merge, ranked by the piece's score;
  - normalizer: sentencepiece's dummy prefix ("▁" before the text, add_dummy_prefix) and " " as "▁";
    nothing else (identity normalization);
  - [MASK] [CLS] [SEP], sentencepiece user-defined symbols (matched in text, never merged), are split
    off as words of their own, and `ignore_merges` maps such a word to its id (transformers' own
    conversion does the same). It maps any word that is a whole vocabulary entry so, as sentencepiece
    does, except the names of control and byte pieces: text that is exactly "<s>" or "<0x41>" right
    after a symbol (up to the next one or the end) is one id here and several in ours. Added tokens
    cannot do the symbols' job: they are cut out before normalizing, which would put a dummy prefix
    before each stretch of text between them instead of once before the text;
  - pad/unk/bos/eos, the symbols and the sentinels are special added tokens (so ids <-> names work),
    and `split_special_tokens` keeps them from being matched in text: our encode spells "<s>" and
    "<extra_id_0>" out as text, and so did our training data. Give a T5 input a sentinel by its id,
    as our collators do, or load with `split_special_tokens=False` to match sentinels in text as HF's
    T5 tokenizer does;
  - decoder: "▁" as space, bytes fused into UTF-8, the dummy prefix dropped; and, as our decode renders
    the ids after a sentinel as a text of their own, also the dummy prefix after each sentinel (through
    a mark, a Unicode noncharacter, which text must not hold).

Encoding adds what the family's training put around one text (its HF adapter's `text_framing`), as
HF's BERT and T5 tokenizers do: an eos before it for causal families (documents follow an eos in the
packed stream, and `scaletrain generate` prompts so), an eos after it for T5, [CLS] A [SEP] (B [SEP])
for BERT. With
`add_special_tokens=False` the ids are exactly `Tokenizer.encode`'s. `decode(ids)` is `Tokenizer.decode`'s
text for ids without pad/unk/bos/eos, which HF writes out by name; `skip_special_tokens=True` drops
those, and the symbols and sentinels with them. tests/checkpoint/test_hf_tokenizer.py checks all this.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from scaletrain.data.tokenizer import BOS, EOS, PAD, SPECIAL_IDS, UNK, USER_SYMBOLS, Tokenizer
from scaletrain.model.family import ModelFamily

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SPACE = "▁"  # sentencepiece's whitespace symbol (U+2581)
# Our layout (data/tokenizer.py): 7 special ids, then 256 byte pieces, then the learned pieces.
FIRST_LEARNED_ID = len(SPECIAL_IDS) + 256
# A Unicode noncharacter (never in interchange text) that marks a sentinel inside the decoder.
SENTINEL_MARK = "\ufdd0"


def write_hf_tokenizer(tokenizer_model: Path, family: ModelFamily, model_max_length: int, out_dir: Path) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir` for the
    sentencepiece model `tokenizer_model` (its .layout.json beside it); returns their paths."""
    adapter = family.hf
    tokenizer = Tokenizer.load(tokenizer_model)
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    backend = backend_tokenizer(processor, tokenizer.num_sentinels, adapter.text_framing)
    special_tokens = _special_tokens(tokenizer.num_sentinels)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "added_tokens_decoder": {str(i): _added_token_fields(token) for i, token in
                                 backend.get_added_tokens_decoder().items()},
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        # GPT-2 adds the embedding of token_type_ids to its input if it is given one; only BERT has types.
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"] if adapter.token_types
        else ["input_ids", "attention_mask"],
    }
    contents = {TOKENIZER_FILE: backend.to_str(pretty=True), CONFIG_FILE: json.dumps(config, indent=2),
                SPECIAL_TOKENS_FILE: json.dumps(special_tokens, indent=2)}
    for name, text in contents.items():
        (Path(out_dir) / name).write_text(text + "\n", encoding="utf-8")
    return [Path(out_dir) / name for name in contents]


def _special_tokens(num_sentinels: int) -> dict[str, str | list[str]]:
    """HF's names for our special pieces (data/tokenizer.py SPECIAL_IDS), the sentinels as T5's."""
    return {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD, "mask_token": "[MASK]",
            "cls_token": "[CLS]", "sep_token": "[SEP]",
            "additional_special_tokens": [f"<extra_id_{i}>" for i in range(num_sentinels)]}


def _added_token_fields(token: AddedToken) -> dict[str, str | bool]:
    """The fields of an `added_tokens_decoder` entry in tokenizer_config.json, as save_pretrained writes them."""
    return {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
            "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}


def backend_tokenizer(processor: spm.SentencePieceProcessor, num_sentinels: int,
                      framing: tuple[str, str]) -> BackendTokenizer:
    """The `tokenizers` pipeline that encodes and decodes as `Tokenizer` (the module docstring says how)."""
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    backend = BackendTokenizer(BPE(vocab={piece: i for i, piece in enumerate(pieces)},
                                   merges=sentencepiece_merges(processor), unk_token=UNK, fuse_unk=True,
                                   byte_fallback=True, ignore_merges=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    user_symbols = "|".join(re.escape(symbol) for symbol in USER_SYMBOLS)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(user_symbols), behavior="isolated")
    backend.decoder = _decoder()
    sentinels = [f"<extra_id_{num_sentinels - 1 - k}>" for k in range(num_sentinels)]  # in id order
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in pieces[:len(SPECIAL_IDS)] + sentinels])
    backend.encode_special_tokens = True
    single, pair = framing
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(EOS, SPECIAL_IDS["eos"]), ("[CLS]", SPECIAL_IDS["cls"]),
                                                  ("[SEP]", SPECIAL_IDS["sep"])])
    return backend


def sentencepiece_merges(processor: spm.SentencePieceProcessor) -> list[tuple[str, str]]:
    """Every way to build each learned piece from two learned pieces, best-scored pieces first.

    sentencepiece may join any adjacent pair whose concatenation is a piece, best score first, leftmost
    on ties; `tokenizers` needs the pairs themselves. Byte and special pieces never take part in a merge.
    """
    learned = range(FIRST_LEARNED_ID, processor.get_piece_size())
    learned_pieces = {processor.id_to_piece(i) for i in learned}
    merges = []
    for piece_id in sorted(learned, key=lambda i: (-processor.get_score(i), i)):
        piece = processor.id_to_piece(piece_id)
        merges += [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))
                   if piece[:cut] in learned_pieces and piece[cut:] in learned_pieces]
    return merges


def _decoder() -> decoders.Sequence:
    """Pieces back to text. A sentinel token is marked first (a lookbehind on the whole token, so text
    that spells a sentinel out is left alone) and the mark takes the space that follows it with it."""
    return decoders.Sequence([
        decoders.Replace(Regex(r"(?<=\A<extra_id_\d{1,9}>)\z"), SENTINEL_MARK),
        decoders.Replace(SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Replace(Regex(SENTINEL_MARK + " ?"), ""),
        decoders.Strip(" ", 1, 0),
    ])
