"""Exact document deduplication: the first document with a given normalised text is kept, later copies dropped.

Published corpora remove exact duplicates before anything fuzzier: CCNet
hashes each paragraph after lower-casing, replacing digits by 0 and stripping
punctuation and accents (Wenzek et al. 2020, "Deduplication"); Dolma drops
documents whose URL, and paragraphs whose text, a Bloom filter has already seen
(allenai/dolma, docs/deduplication.md); RefinedWeb combines MinHash
near-duplicate removal with exact-substring removal (Penedo et al. 2023; Lee et
al. 2022). We hash whole documents after a milder normalisation that only undoes
encoding accidents: Unicode NFKC (full-width and ligature forms), case folding,
and every whitespace run (CRLF, trailing blanks, re-wrapped lines) collapsed to
one space. Digits, punctuation and accents are kept: whole documents that differ
in them are different editions, which a corpus recipe's near-duplicate step
(e.g. data_pipelines/shakespeare.py) decides on.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable

# 128 bits: collisions stay negligible (~n^2 / 2^129) for any corpus that fits on disk.
DIGEST_BYTES = 16


def normalise_for_dedup(text: str) -> str:
    """NFKC, case-folded, whitespace runs collapsed to one space and trimmed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def text_digest(text: str) -> bytes:
    """BLAKE2b digest of the normalised text: what two documents must share to count as duplicates."""
    return hashlib.blake2b(normalise_for_dedup(text).encode(), digest_size=DIGEST_BYTES).digest()


def find_exact_duplicates(texts: Iterable[str]) -> list[bool]:
    """Per text, in order: True when an earlier text has the same normalised form.

    One pass, holding only the digests seen so far (16 bytes each plus a set entry);
    at billions of documents a Bloom filter, as Dolma uses, would bound that memory.
    """
    seen: set[bytes] = set()
    duplicates: list[bool] = []
    for text in texts:
        digest = text_digest(text)
        duplicates.append(digest in seen)
        seen.add(digest)
    return duplicates
