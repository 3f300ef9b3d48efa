"""Sentencepiece BPE tokenizer with the fixed special-id layout that GPT, BERT and T5 share.

Layout (ids):
  0 <pad>, 1 <unk>, 2 <s> (bos), 3 </s> (eos), 4 [MASK], 5 [CLS], 6 [SEP],
  then sentencepiece's 256 byte pieces and the learned BPE merges, then the
  T5 sentinels `<extra_id_i>` appended after the sentencepiece vocabulary,
  counting down from the end: sentinel i has id vocab_size - 1 - i (as Hugging
  Face's T5Tokenizer does), so <extra_id_0> is the last id.

Text round-trips exactly: identity normalization (no NFKC, no whitespace
collapsing) and byte fallback for every character the merges do not cover,
newline included (training sees lines, so "\\n" is always the byte <0x0A>).
`[MASK]`, `[CLS]`, `[SEP]` written literally in text encode to their ids.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from scaletrain.config import ConfigError, DataConfig
from scaletrain.data.documents import Document, iter_texts, list_documents
from scaletrain.data.errors import DataError
from scaletrain.disk import write_atomically

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
USER_SYMBOLS = ("[MASK]", "[CLS]", "[SEP]")
SPECIAL_IDS = {"pad": 0, "unk": 1, "bos": 2, "eos": 3, "mask": 4, "cls": 5, "sep": 6}
BYTE_PIECES = 256  # sentencepiece's byte-fallback pieces <0x00>..<0xFF>, ids 7-262
# The fewest learned pieces a config may leave: fewer would encode text mostly as bytes (a floor, not a
# tuned value; train_tokenizer itself needs one).
MIN_LEARNED_PIECES = 64
LAYOUT_SUFFIX = ".layout.json"
LAYOUT_VERSION = 1
# sentencepiece drops longer training lines; we cut them instead (bytes, UTF-8 <= 4 per char).
MAX_TRAINING_LINE_CHARS = 4096


def reserved_ids(num_sentinels: int) -> int:
    """Ids that are not learned pieces: the special ids, the byte pieces and the sentinels."""
    return len(SPECIAL_IDS) + BYTE_PIECES + num_sentinels


def validate_vocab_size(data: DataConfig) -> None:
    """Refuse, when a config is loaded, a data.vocab_size that leaves too few learned pieces after the
    reserved ids (config_loader.validate runs it, before `prepare` or training writes anything)."""
    reserved = reserved_ids(data.num_sentinels)
    if data.vocab_size < reserved + MIN_LEARNED_PIECES:
        raise ConfigError(
            f"data.vocab_size={data.vocab_size} leaves too few learned pieces after {reserved} reserved ones "
            f"(special tokens, byte fallback, {data.num_sentinels} sentinels); use at least "
            f"{reserved + MIN_LEARNED_PIECES}"
        )


def train_tokenizer(
    sources: Sequence[Path] | Sequence[Document],
    output_prefix: Path,
    vocab_size: int,
    num_sentinels: int = 100,
    seed: int = 0,
    max_sentences: int = 2_000_000,
    sample_bytes: int | None = None,
) -> Path:
    """Train a BPE model on the lines of `sources`; write `<prefix>.model` and `<prefix>.layout.json`.

    `sources` are raw files, or the Documents `prepare` kept after deduplication.
    sentencepiece learns `vocab_size - num_sentinels` pieces; the sentinels take
    the last `num_sentinels` ids. With `sample_bytes` it learns from a seeded
    sample of about that many bytes (see `tokenizer_training_lines`). Deterministic:
    lines are subsampled (if there are more than `max_sentences`) by our own seeded
    generator, and training runs on one thread (thread count is recorded in the
    model file, and BPE on a few MB takes about a second anyway). Returns the `.model` path.
    """
    num_pieces = vocab_size - num_sentinels
    minimum = len(SPECIAL_IDS) + BYTE_PIECES + 1
    if num_sentinels < 0 or num_pieces < minimum:
        raise DataError(
            f"vocab_size={vocab_size} with num_sentinels={num_sentinels} leaves {num_pieces} sentencepiece pieces; "
            f"need at least {minimum} (7 special ids + 256 byte pieces + merges): raise vocab_size."
        )
    documents = [s for s in sources if isinstance(s, Document)] or list_documents([Path(s) for s in sources])
    lines = tokenizer_training_lines(documents, seed, max_sentences, sample_bytes)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=num_pieces,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=PAD, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
            user_defined_symbols=list(USER_SYMBOLS), byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
            input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=4 * MAX_TRAINING_LINE_CHARS,
            num_threads=1, minloglevel=2,
        )
    except RuntimeError as error:
        raise DataError(
            f"sentencepiece could not train vocab_size={vocab_size} (num_sentinels={num_sentinels}) on "
            f"{len(lines):,} lines of {len(sources)} sources: {error}. Lower vocab_size or add text."
        ) from error
    return write_tokenizer(Path(output_prefix), model.getvalue(), num_sentinels)


def tokenizer_training_lines(documents: Sequence[Document], seed: int, max_sentences: int = 2_000_000,
                             sample_bytes: int | None = None) -> list[str]:
    """The non-blank lines sentencepiece learns from: all of them, or a seeded sample.

    With `sample_bytes`, documents are taken in the order of a hash of (seed, name)
    until their sizes add up to the budget, and lines are read from them only until
    each one's share is spent, so the lines total at most `sample_bytes` UTF-8 bytes
    and no other .txt file is read (a .jsonl file holding a sampled line is still
    scanned for it): a tokenizer learns its merges from a few GB as well as from
    hundreds. The sample is a function of (seed, document names and sizes). Past `max_sentences`
    lines, a seeded subset is chosen in a second pass so that only the chosen lines,
    never the whole corpus, are held in memory.
    """
    shares = None
    if sample_bytes is not None:
        documents, shares = sample_documents(documents, sample_bytes, seed)
    total = sum(1 for _ in _lines(documents, shares))
    if total == 0:
        where = ", ".join(str(doc.path) for doc in documents[:3])
        raise DataError(f"no text to train the tokenizer on in {len(documents)} documents, e.g. {where}")
    if total <= max_sentences:
        return list(_lines(documents, shares))
    chosen = np.zeros(total, dtype=bool)
    chosen[np.random.default_rng(seed).choice(total, size=max_sentences, replace=False)] = True
    return [line for number, line in enumerate(_lines(documents, shares)) if chosen[number]]


def sample_documents(documents: Sequence[Document], sample_bytes: int,
                     seed: int) -> tuple[list[Document], list[int]]:
    """A seeded sample of about `sample_bytes`: (documents in corpus order, bytes to take from each)."""
    if sample_bytes <= 0:
        raise DataError(f"tokenizer_train_bytes={sample_bytes} must be positive")

    def sample_key(index: int) -> bytes:
        return hashlib.sha256(f"tokenizer-sample:{seed}:{documents[index].name}".encode()).digest()

    shares: dict[int, int] = {}
    remaining = sample_bytes
    for index in sorted(range(len(documents)), key=sample_key):
        if remaining <= 0:
            break
        shares[index] = min(max(documents[index].num_bytes, 1), remaining)
        remaining -= shares[index]
    chosen = sorted(shares)
    return [documents[index] for index in chosen], [shares[index] for index in chosen]


def _lines(documents: Sequence[Document], shares: Sequence[int] | None = None) -> Iterator[str]:
    """Training lines, cut to MAX_TRAINING_LINE_CHARS; with `shares`, at most that many bytes per document."""
    for number, text in enumerate(iter_texts(documents)):
        budget = None if shares is None else shares[number]
        for line in text.split("\n"):
            if not line.strip():
                continue
            line = line[:MAX_TRAINING_LINE_CHARS]
            if budget is not None:
                budget -= len(line.encode())
                if budget < 0:
                    break
            yield line


def write_tokenizer(prefix: Path, model_bytes: bytes, num_sentinels: int) -> Path:
    """Write `<prefix>.model` and the `<prefix>.layout.json` that `Tokenizer.load` checks it against."""
    model_path = prefix.with_name(prefix.name + ".model")
    processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    layout = {
        "layout_version": LAYOUT_VERSION,
        "model_file": model_path.name,
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "sentencepiece_size": processor.get_piece_size(),
        "num_sentinels": num_sentinels,
        "vocab_size": processor.get_piece_size() + num_sentinels,
        "special_ids": SPECIAL_IDS,
    }
    model_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(model_path, model_bytes)
    write_atomically(_layout_path(prefix), (json.dumps(layout, indent=1) + "\n").encode())
    return model_path


def read_reusable_model(model_file: Path, vocab_size: int, num_sentinels: int) -> bytes:
    """The bytes of an existing sentencepiece model, once checked to fit this vocab_size and num_sentinels.

    Datasets that share a tokenizer share token ids, so a model trained on one
    corpus (or a sample of it) can tokenize another, or a larger version of the
    same. It must have our layout: the 7 special pieces, then the 256 byte pieces
    (byte fallback, which exact round trips and '\\n' as <0x0A> rely on). A
    `<prefix>.layout.json` beside it (as `prepare` writes) must agree with it.
    """
    model_file = Path(model_file)
    fix = "point data.tokenizer at another dataset's tokenizer.model, or remove it to train a new tokenizer"
    if not model_file.is_file():
        raise DataError(f"data.tokenizer={model_file} is not a file; {fix}")
    model_bytes = model_file.read_bytes()
    try:
        processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    except RuntimeError as error:
        raise DataError(f"data.tokenizer={model_file} is not a sentencepiece model ({error}); {fix}") from error
    _check_reusable_layout(model_file, processor, fix)
    layout_path = _layout_path(_prefix_of(model_file))
    layout = json.loads(layout_path.read_text()) if layout_path.is_file() else None
    pieces = processor.get_piece_size()
    sentinels = num_sentinels if layout is None else layout["num_sentinels"]
    if layout is not None and layout["model_sha256"] != hashlib.sha256(model_bytes).hexdigest():
        raise DataError(f"data.tokenizer={model_file} does not match {layout_path} beside it (another training); "
                        f"copy the two files together, or {fix}")
    if (pieces + num_sentinels, num_sentinels) != (vocab_size, sentinels):
        made_with = "" if layout is None else f" (it was made with num_sentinels={sentinels})"
        raise DataError(
            f"data.tokenizer={model_file} has {pieces} sentencepiece pieces{made_with}, which does not fit "
            f"data.vocab_size={vocab_size} with data.num_sentinels={num_sentinels}: set "
            f"data.vocab_size={pieces + sentinels} data.num_sentinels={sentinels} to reuse it, "
            "or remove data.tokenizer to train a new tokenizer"
        )
    return model_bytes


def _check_reusable_layout(model_file: Path, processor: spm.SentencePieceProcessor, fix: str) -> None:
    expected = [PAD, UNK, BOS, EOS, *USER_SYMBOLS, *(f"<0x{byte:02X}>" for byte in range(256))]
    if processor.get_piece_size() < len(expected) or [
        processor.id_to_piece(i) for i in range(len(expected))
    ] != expected:
        raise DataError(
            f"data.tokenizer={model_file} lacks scaletrain's id layout (ids 0-6 {expected[:7]}, then the 256 byte "
            f"pieces <0x00>..<0xFF>); it was not made by `scaletrain prepare`: {fix}"
        )


def _prefix_of(path: Path) -> Path:
    path = Path(path)
    if path.is_dir():
        layouts = sorted(path.glob("*" + LAYOUT_SUFFIX))
        if len(layouts) != 1:
            found = "none" if not layouts else ", ".join(p.name for p in layouts)
            raise DataError(
                f"{path} should hold exactly one tokenizer (*{LAYOUT_SUFFIX}), found {found}; "
                "run `scaletrain prepare CONFIG`, or pass the tokenizer's .model path"
            )
        path = layouts[0]
    for suffix in (".model", LAYOUT_SUFFIX):
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)])
    return path


def _layout_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + LAYOUT_SUFFIX)


class Tokenizer:
    """Encode/decode with the scaletrain id layout; sentinels live outside sentencepiece."""

    def __init__(self, processor: spm.SentencePieceProcessor, num_sentinels: int) -> None:
        self._processor = processor
        self._num_pieces = processor.get_piece_size()
        self._num_sentinels = num_sentinels

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """Load from a prepared data dir, or the prefix / `.model` / `.layout.json` that `train_tokenizer` wrote."""
        prefix = _prefix_of(path)
        layout_path = _layout_path(prefix)
        if not layout_path.exists():
            raise DataError(f"tokenizer layout {layout_path} not found; train the tokenizer with `scaletrain prepare`.")
        layout = json.loads(layout_path.read_text())
        model_path = layout_path.with_name(layout["model_file"])
        if not model_path.exists():
            raise DataError(
                f"tokenizer model {model_path} (named in {layout_path}) not found; re-run `scaletrain prepare`"
            )
        model_bytes = model_path.read_bytes()
        actual = hashlib.sha256(model_bytes).hexdigest()
        if actual != layout["model_sha256"]:
            raise DataError(
                f"tokenizer model {model_path} has sha256 {actual} but {layout_path} expects {layout['model_sha256']}; "
                "the two files come from different trainings: re-run `scaletrain prepare`."
            )
        tokenizer = cls(spm.SentencePieceProcessor(model_proto=model_bytes), layout["num_sentinels"])
        tokenizer._check_layout(model_path)
        return tokenizer

    def _check_layout(self, model_path: Path) -> None:
        expected = {0: PAD, 1: UNK, 2: BOS, 3: EOS, **{4 + i: s for i, s in enumerate(USER_SYMBOLS)}}
        actual = {i: self._processor.id_to_piece(i) for i in expected}
        if actual != expected:
            raise DataError(
                f"{model_path} has special pieces {actual}, expected {expected}; train it with train_tokenizer"
            )

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """Ids of each text, as `encode` gives them, encoded on `num_threads` of sentencepiece's C++ threads.

        One call per batch costs one Python round trip instead of one per text,
        and the threads share one loaded model (benchmarks/tokenize_throughput.py).
        """
        return self._processor.encode(texts, num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; sentinel ids render as `<extra_id_i>`, pad/bos/eos as nothing."""
        parts: list[str] = []
        run: list[int] = []
        for token in (int(t) for t in ids):
            if not 0 <= token < self.vocab_size:
                raise DataError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
            if token < self._num_pieces:
                run.append(token)
                continue
            parts.append(self._processor.decode(run))
            run = []
            parts.append(f"<extra_id_{self.vocab_size - 1 - token}>")
        parts.append(self._processor.decode(run))
        return "".join(parts)

    @property
    def vocab_size(self) -> int:
        """Sentencepiece pieces plus sentinels: the embedding table size."""
        return self._num_pieces + self._num_sentinels

    @property
    def num_sentinels(self) -> int:
        return self._num_sentinels

    def sentinel_id(self, i: int) -> int:
        """Id of `<extra_id_i>`, counting down from the end of the vocabulary (T5 convention)."""
        if not 0 <= i < self._num_sentinels:
            raise DataError(f"sentinel index {i} out of range; this tokenizer has {self._num_sentinels} sentinels")
        return self.vocab_size - 1 - i

    @property
    def pad_id(self) -> int:
        return SPECIAL_IDS["pad"]

    @property
    def unk_id(self) -> int:
        return SPECIAL_IDS["unk"]

    @property
    def bos_id(self) -> int:
        return SPECIAL_IDS["bos"]

    @property
    def eos_id(self) -> int:
        return SPECIAL_IDS["eos"]

    @property
    def mask_id(self) -> int:
        return SPECIAL_IDS["mask"]

    @property
    def cls_id(self) -> int:
        return SPECIAL_IDS["cls"]

    @property
    def sep_id(self) -> int:
        return SPECIAL_IDS["sep"]

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that are never ordinary text: pad..sep and every sentinel."""
        sentinels = range(self._num_pieces, self.vocab_size)
        return frozenset(SPECIAL_IDS.values()) | frozenset(sentinels)
