"""Tokenization throughput of `prepare` against a plain sentencepiece encode loop, and prepare end to end.

On the same documents and the same tokenizer, in one run: a loop of
`SentencePieceProcessor.encode(text)` (the reference: what any script would
write), then `prepare`'s tokenization path (scaletrain.data.prepare.tokenize_texts)
with 1 and with 2 workers, alternating and taking medians so that load from
other processes hits every variant alike. Texts are read into memory first, so
these figures are tokenization alone. `--end-to-end` also times `prepare_dataset`
with the same tokenizer reused: reading, deduplication, tokenization, shard
writing and checksums.

    python benchmarks/tokenize_throughput.py data/raw/shakespeare --repeats 5 --end-to-end
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import sentencepiece as spm

from scaletrain.data.documents import iter_texts, list_documents, resolve_raw_paths
from scaletrain.data.prepare import prepare_dataset, tokenize_texts
from scaletrain.data.shards import token_dtype
from scaletrain.data.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[1]


def median_seconds(runs: dict, repeats: int) -> tuple[dict, dict]:
    """Each run's median wall and CPU time (all threads) over `repeats` rounds; a round runs every variant once.

    CPU time shows the work per core apart from the wall time, which other
    processes on a shared machine stretch.
    """
    wall: dict = {name: [] for name in runs}
    cpu: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return ({name: statistics.median(values) for name, values in wall.items()},
            {name: statistics.median(values) for name, values in cpu.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", nargs="*", default=[str(REPO / "data" / "raw" / "shakespeare")],
                        help="raw .txt/.jsonl files, directories or globs (default: data/raw/shakespeare, "
                             "built by `make corpus`)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary (default 8192)")
    parser.add_argument("--num-sentinels", type=int, default=100, help="T5 sentinels (default 100)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker counts of prepare's path to time (default: 1 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--end-to-end", action="store_true",
                        help="also time prepare_dataset (read, dedup, tokenize, write shards) per worker count")
    args = parser.parse_args()

    documents = list_documents(resolve_raw_paths(args.raw))
    texts = list(iter_texts(documents))
    num_bytes = sum(len(text.encode()) for text in texts)
    with tempfile.TemporaryDirectory(prefix="tokenize-throughput-") as scratch:
        model = train_tokenizer(documents, Path(scratch) / "tokenizer", args.vocab_size, args.num_sentinels)
        processor = spm.SentencePieceProcessor(model_file=str(model))
        dtype = token_dtype(args.vocab_size)
        num_tokens = sum(len(processor.encode(text)) for text in texts)
        print(f"corpus: {len(texts):,} documents, {num_bytes / 1e6:.2f} MB, {num_tokens:,} tokens "
              f"(vocab_size {args.vocab_size}), {args.repeats} rounds, medians")

        runs = {"plain": lambda: [processor.encode(text) for text in texts]}
        for workers in args.workers:
            runs[f"prepare-{workers}"] = lambda workers=workers: list(tokenize_texts(model, texts, workers, dtype))
        seconds, cpu_seconds = median_seconds(runs, args.repeats)
        report("plain sentencepiece encode loop", seconds["plain"], cpu_seconds["plain"], num_tokens, num_bytes)
        first = seconds[f"prepare-{args.workers[0]}"]
        for workers in args.workers:
            name = f"prepare-{workers}"
            report(f"prepare tokenization, {workers} worker(s)", seconds[name], cpu_seconds[name], num_tokens,
                   num_bytes, f"; {seconds['plain'] / seconds[name]:.2f}x the plain loop, "
                   f"{first / seconds[name]:.2f}x {args.workers[0]} worker(s)")
        if args.end_to_end:
            time_end_to_end(args, model, Path(scratch), num_tokens, num_bytes)


def time_end_to_end(args: argparse.Namespace, model: Path, scratch: Path, num_tokens: int, num_bytes: int) -> None:
    settings = {"vocab_size": args.vocab_size, "num_sentinels": args.num_sentinels, "val_fraction": 0.0,
                "max_tokens_per_shard": 1 << 22, "seed": 0, "overwrite": True, "tokenizer_file": model}
    runs = {workers: lambda workers=workers: prepare_dataset(args.raw, scratch / f"data-{workers}", **settings,
                                                            num_workers=workers)
            for workers in args.workers}
    seconds, cpu_seconds = median_seconds(runs, args.repeats)
    for workers in args.workers:
        report(f"prepare end to end, {workers} worker(s)", seconds[workers], cpu_seconds[workers], num_tokens,
               num_bytes, f"; {seconds[args.workers[0]] / seconds[workers]:.2f}x {args.workers[0]} worker(s)")


def report(label: str, seconds: float, cpu_seconds: float, num_tokens: int, num_bytes: int, suffix: str = "") -> None:
    print(f"{label}: {num_tokens / seconds:,.0f} tokens/s, {num_bytes / seconds / 1e6:.2f} MB/s "
          f"({seconds:.3f} s wall, {cpu_seconds:.3f} s CPU){suffix}")


if __name__ == "__main__":
    main()
