"""Data: tokenizer training, webdataset shards + manifest, packed-sequence loader and collators.

Modules, one concern each:
  errors      DataError, the one exception for data problems a user can fix
  tokenizer   sentencepiece BPE with the fixed special-id layout BERT/T5 rely on
  documents   raw input files -> named documents, deterministic train/val split
  dedup       exact deduplication of documents by a hash of their normalised text
  shards      webdataset tar shards, the byte-offset index, and the checked reader of their token bytes
  manifest    manifest.json: what was prepared, with checksums; loading + checks
  storage     where a dataset lives: local, fsspec URL or pipe: command; the verified shard cache
  prepare     `prepare_dataset`: all of the above, published atomically
  dataset     packed next-token sequences read straight from the shards
  sampler     sample order as a function of (seed, global index); DP rank slicing
  blend       weighted blends of prepared datasets, a function of (seed, global index) too
  loader      DataLoaders for training and evaluation
  objectives  collators per training objective
"""
