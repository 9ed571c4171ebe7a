"""Benchmark inputs shared by the scripts in this folder (imported as a sibling module).

Real traces are read from a path (default `../shared/traces/...`) and never copied; without
them the shipped synthetic trace is used, and without that a seeded generated load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eplb.formats import load_trace


def workloads(traces_dir: Path, fallback: Path, num_logical_experts: int = 256):
    """(name, load_LE) pairs: real traces, else the synthetic trace, else a generated load."""
    if traces_dir.is_dir() and sorted(traces_dir.glob("*.json")):
        for f in sorted(traces_dir.glob("*.json")):
            yield f.stem, load_trace(f).counts_TLE.sum(axis=0).astype(np.float64)
        return
    if fallback.is_file():
        load_LE = load_trace(fallback).counts_TLE.sum(axis=0).astype(np.float64)
        yield f"{fallback.name} (synthetic, all windows)", load_LE
        return
    rng = np.random.default_rng(0)
    yield "generated (seeded Pareto)", np.floor(rng.pareto(1.2, (58, num_logical_experts)) * 1000) + 1
