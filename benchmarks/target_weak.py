"""Benchmark "target_weak": the "target" section from a weak (20-50% held-out) SFT start (benchmarks/target.py)."""

from benchmarks.target import run_starts


def run(quick: bool = False) -> dict:
    return run_starts("weak", quick)
