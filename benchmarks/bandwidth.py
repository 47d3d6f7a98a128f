"""This machine's memory read bandwidth, measured the way a decode step reads its weights: one streaming pass over a
buffer far larger than any cache, with the benchmark's thread count.

Decode of a small model at batch 1 is bound by reading the weights once per token, so a decode table reports each
system's weight-read rate (model bytes ÷ ms/token) next to this number (benchmarks/decode.py prints both, measured
in the same run: a shared machine's bandwidth moves from hour to hour).

    .venv/bin/python benchmarks/bandwidth.py --threads 2
"""

from __future__ import annotations

import argparse
import time

GIB = 1 << 30


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 7) -> float:
    """GB/s (10⁹ bytes) of the fastest of `repeats` float32 sums over a `gib`-GiB buffer with `threads` threads
    (torch's parallel reduction: vectorized loads, one pass, nothing written back)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(gib * GIB) // 4, dtype=torch.float32)
        buffer.sum()  # first touch done by ones(); this warms the thread pool
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gib", type=float, default=1.0, help="buffer size (far above the last-level cache)")
    args = parser.parse_args()
    if args.threads < 1 or args.gib <= 0:
        parser.error("--threads must be at least 1 and --gib positive")
    print(f"memory read bandwidth, {args.threads} threads, {args.gib:g} GiB float32 sum: "
          f"{read_bandwidth(args.threads, args.gib):.1f} GB/s")


if __name__ == "__main__":
    main()
