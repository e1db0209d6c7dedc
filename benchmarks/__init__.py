"""Benchmark sections run by bin/bench. Each module exposes ``run(quick=False) -> dict`` with keys
``section``, ``results`` (JSON-able) and ``markdown``. Ratios are measured within one run (noisy machine)."""
