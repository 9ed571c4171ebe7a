"""SGLang expert-distribution statistics (import) and `--init-expert-location` (export).

SGLang's recorder (stat mode) dumps `{"logical_count": ...}` as JSON or a torch `.pt`
file: either [hidden layers, experts] totals or [steps, hidden layers, experts]. Dense
layers appear as all-zero rows; they are dropped on import and their ids kept in layer_ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from eplb.errors import EplbError
from eplb.trace import Trace, default_meta


def trace_from_logical_count(logical_count: Any, *, source: str) -> Trace:
    """Build a Trace from SGLang's `logical_count` ([layers, E] or [steps, layers, E])."""
    try:
        c = np.asarray(logical_count, dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise EplbError(f"{source}: logical_count must be a rectangular array of numbers ({exc})") from None
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3:
        raise EplbError(f"{source}: logical_count must be [layers, experts] or [steps, layers, experts], got shape {c.shape}")
    if not np.all(np.isfinite(c)) or (c.size and c.min() < 0):
        raise EplbError(f"{source}: logical_count holds negative, NaN or infinite values")
    moe = np.flatnonzero(c.sum(axis=(0, 2)) > 0)
    if moe.size == 0:
        raise EplbError(f"{source}: every layer of logical_count is zero (no tokens recorded)")
    meta = default_meta(c.shape[1], c.shape[2], source=f"sglang expert-distribution recorder: {Path(source).name}")
    return Trace(np.rint(c[:, moe]).astype(np.int64), moe.astype(np.int64), meta)


def read_json(path: Path, data: Any | None = None) -> Trace:
    if data is None:
        data = json.loads(path.read_text())
    if not isinstance(data, dict) or "logical_count" not in data:
        raise EplbError(f"{path}: not SGLang expert-distribution JSON (no 'logical_count' key)")
    return trace_from_logical_count(data["logical_count"], source=str(path))


def read_pt(path: Path) -> Trace:
    import torch  # only this importer needs torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unsafe or corrupt files
        raise EplbError(f"{path}: cannot load as a weights-only torch file ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict) or "logical_count" not in obj:
        raise EplbError(f"{path}: torch file holds no 'logical_count' (not an SGLang expert-distribution dump)")
    lc = obj["logical_count"]
    if isinstance(lc, torch.Tensor):
        lc = lc.detach().cpu().numpy()
    return trace_from_logical_count(lc, source=str(path))
