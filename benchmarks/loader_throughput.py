"""Training-loader throughput (samples/s) for 1, 2, 4 workers, local and over HTTP, against GPT-350M's appetite.

The loader is the one `Objective.train_loader` builds: GlobalIndexDataset over PackedSequenceDataset,
DistributedPretrainingSampler, causal_lm_collate, torch DataLoader. The data is a prepared dataset
(--data) or a synthetic one written here with SplitShardWriter: random tokens in a GPT-2-sized
vocabulary (uint16, as a real 50k-vocabulary dataset stores them), documents of random lengths.

Remote figures use a ThreadingHTTPServer on 127.0.0.1 inside this process: "warm" reads shards
already in the cache (what every pass after the first does), "cold" starts from an empty cache and
includes downloading each shard the batches touch, so it measures this machine's loopback and disk,
not a real object store.

The demand: a GPT-350M trains at about 40k tokens/s per GPU, 8 GPUs per node, so a node consumes
320k tokens/s = 156 samples/s of 2048 tokens, one rank (= one loader) 19.5 samples/s. Each rank runs
its own loader with its own workers, so a node runs 8 of the loaders measured here; the headroom per
node is 8 x (one loader's samples/s) / 156, which assumes the node has cores for 8 x (workers + 1)
processes (8-GPU nodes have 64-128). A second, pessimistic figure divides one loader's rate by the
whole node's 156 samples/s, as if one loader had to feed all 8 GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import itertools
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from scaletrain.data.dataset import GlobalIndexDataset, PackedSequenceDataset
from scaletrain.data.loader import batch_loader
from scaletrain.data.manifest import Manifest, SplitInfo, file_sha256, write_manifest
from scaletrain.data.objectives import causal_lm_collate
from scaletrain.data.sampler import DistributedPretrainingSampler, GlobalSampleOrder
from scaletrain.data.shards import SplitShardWriter, token_dtype
from scaletrain.data.storage import ShardCacheSettings, open_location

GPU_TOKENS_PER_SECOND = 40_000  # GPT-350M per GPU
GPUS_PER_NODE = 8
GPT2_VOCAB = 50_257


def write_synthetic_dataset(directory: Path, num_tokens: int, max_tokens_per_shard: int, seed: int = 0) -> Path:
    """A train split of random-token documents (lengths 50..4000) with its index and manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(GPT2_VOCAB)
    writer = SplitShardWriter(directory, "train", max_tokens_per_shard, dtype)
    written = 0
    for doc_id in itertools.count():
        if written >= num_tokens:
            break
        length = int(rng.integers(50, 4000))
        writer.add(doc_id, rng.integers(0, GPT2_VOCAB - 1, size=length, dtype=dtype))
        written += length
    shards, index = writer.close()
    index.save(directory / "train.index.npz")
    tokenizer = directory / "tokenizer.synthetic"  # no real tokenizer: the loader only checks its checksum
    tokenizer.write_bytes(b"synthetic random tokens\n")
    split = SplitInfo(tuple(shards), sum(s.num_docs for s in shards), sum(s.num_tokens for s in shards),
                      "train.index.npz", file_sha256(directory / "train.index.npz"))
    write_manifest(Manifest(tokenizer.name, file_sha256(tokenizer), GPT2_VOCAB, 0, GPT2_VOCAB - 1, dtype.name,
                            {"train": split}), directory)
    return directory


def train_loader(location: Path | str, seq_length: int, micro_batch_size: int, workers: int,
                 cache: ShardCacheSettings | None) -> DataLoader:
    """What Objective.train_loader builds for a causal LM on data-parallel rank 0 of 1."""
    packed = PackedSequenceDataset(location, "train", seq_length, cache=cache)
    dataset = GlobalIndexDataset(packed, GlobalSampleOrder(packed.num_samples, seed=1234))
    sampler = DistributedPretrainingSampler(micro_batch_size, 0, 1, consumed_samples=0)
    return batch_loader(dataset, sampler, workers, causal_lm_collate)


def samples_per_second(make_loader, micro_batch_size: int, batches: int, warmup: int) -> float:
    """Steady-state rate after `warmup` batches (worker start-up excluded); warmup=0 times from the start."""
    loader = iter(make_loader())
    for _ in range(warmup):
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * micro_batch_size / (time.perf_counter() - start)


@contextlib.contextmanager
def http_server(directory: Path) -> Iterator[str]:
    handler = type("QuietHandler", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *args: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def report(label: str, workers: int, rate: float, seq_length: int) -> None:
    gpu_samples = GPU_TOKENS_PER_SECOND / seq_length
    node_samples = gpu_samples * GPUS_PER_NODE
    print(f"{label:<11} workers={workers}: {rate:8.1f} samples/s, {rate * seq_length:10,.0f} tokens/s; "
          f"headroom per node (8 loaders) {GPUS_PER_NODE * rate / node_samples:6.1f}x, "
          f"one loader for the whole node {rate / node_samples:5.1f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="a prepared dataset (default: write a synthetic one)")
    parser.add_argument("--tokens", type=int, default=40_000_000, help="synthetic dataset size (default: 40M)")
    parser.add_argument("--tokens-per-shard", type=int, default=1 << 22, help="synthetic shard size (default: 4M)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=100, help="timed batches per configuration")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache HTTP pass")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loader-throughput-") as scratch:
        scratch = Path(scratch)
        if args.data is None:
            args.data = write_synthetic_dataset(scratch / "data", args.tokens, args.tokens_per_shard)
        packed = PackedSequenceDataset(args.data, "train", args.seq_length)
        print(f"dataset {args.data}: {packed.num_samples:,} samples of {args.seq_length} tokens, "
              f"micro-batch {args.micro_batch}; demand {GPU_TOKENS_PER_SECOND:,} tokens/s per GPU x "
              f"{GPUS_PER_NODE} GPUs = {GPU_TOKENS_PER_SECOND * GPUS_PER_NODE / args.seq_length:.1f} samples/s "
              "per node", flush=True)
        warm_cache = ShardCacheSettings(scratch / "warm-cache", limit_bytes=1 << 40)
        with http_server(args.data) as url:
            remote = open_location(url, warm_cache)
            for shard in remote.load_manifest().split("train").shards:
                remote.open_shard(shard)  # fill the cache
            for workers in args.workers:
                loaders = {"local": lambda w=workers: train_loader(args.data, args.seq_length, args.micro_batch, w,
                                                                   None),
                           "http warm": lambda w=workers: train_loader(url, args.seq_length, args.micro_batch, w,
                                                                       warm_cache)}
                for label, make_loader in loaders.items():
                    rate = samples_per_second(make_loader, args.micro_batch, args.batches, warmup=2 * workers)
                    report(label, workers, rate, args.seq_length)
                if not args.no_cold:
                    cold_cache = ShardCacheSettings(scratch / f"cold-cache-{workers}", limit_bytes=1 << 40)
                    rate = samples_per_second(
                        lambda w=workers, c=cold_cache: train_loader(url, args.seq_length, args.micro_batch, w, c),
                        args.micro_batch, args.batches, warmup=0)
                    report("http cold", workers, rate, args.seq_length)


if __name__ == "__main__":
    main()
