"""The file `eplb replay -o replay.npz` writes, and reading it back (no pickle).

Legend: T = served windows, L = MoE layers, E = logical experts, P = physical slots,
R = dispatch rules scored.

Arrays (for the served windows only, in order):
- `phy2log_TLP` int64 [T, L, P]: the placement in force while window t was served
- `weights_TLP` float64 [T, L, P]: the shares of the rule named in meta `weights_rule` used
  for window t (the per-batch re-split when scored; with modeled time, the time dispatch's
  shares of each expert's rows over the window's batches)
- `counts_TLE` int64 [T, L, E]: the window's logical counts
- `window_T`, `decided_T`, `applied_T`, `moves_T`, `rounds_T` (and `bytes_T` given bytes per
  expert): the window's index in the cut trace, whether a decision followed it, whether a new
  placement took effect at it, and that decision's moves and migration rounds
- `{run}_imbalance_RTL` [R, T, L] and `{run}_balancedness_RT` [R, T] for run = policy, static,
  hindsight (the references scored), in the order of meta `rules`; with modeled time scored,
  `{run}_seconds_RTL` [R, T, L] too: MoE seconds per step and layer, the mean over the
  window's batches (meta `time` says how they were made)
- `meta`: JSON text, the replay's summary (settings, overall figures) without the per-window list
So anyone can re-score a run: `Placement(phy2log_TLP[t], G, E)` with `counts_TLE[t]` and the
shares give the GPU loads of window t.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eplb.core.files import as_path, input_file, load_npz, parse_json
from eplb.core.outputs import atomic_output
from eplb.errors import EplbError

REQUIRED = ("phy2log_TLP", "weights_TLP", "counts_TLE", "window_T", "decided_T", "applied_T", "moves_T",
            "rounds_T", "policy_imbalance_RTL", "policy_balancedness_RT", "meta")


def write_replay(result, path: str | Path) -> Path:
    """Write a ReplayResult atomically (eplb.core.files): a failed write leaves an existing file as it was."""
    path = as_path(path, "the file path")
    meta = {k: v for k, v in result.summary().items() if k != "per_window"}
    meta["weights_rule"] = result.weights_rule
    arrays = {**result.arrays(), "meta": np.array(json.dumps(meta))}
    with atomic_output(path, what="the replay") as f:
        np.savez_compressed(f, **arrays)
    return path


def read_replay(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of a replay file, with every array's shape checked against the others."""
    path = as_path(path, "the file path")
    if not path.exists():
        raise EplbError(f"replay file {str(path)!r} does not exist (write one with eplb replay ... -o replay.npz)")
    input_file(path, "replay file")
    arrays = load_npz(path)  # declared sizes within the input limit, no objects, nothing truncated
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise EplbError(f"{path}: not an eplb replay file (missing {', '.join(missing)}); write one with "
                        f"eplb replay TRACE ... -o {path.name}")
    meta_text = arrays.pop("meta")
    if meta_text.dtype.kind != "U" or meta_text.ndim != 0:
        raise EplbError(f"{path}: meta must be one JSON string, got an array of dtype {meta_text.dtype} "
                        f"and shape {meta_text.shape}")
    meta = parse_json(str(meta_text).encode("utf-8"), f"{path}: meta")
    if not isinstance(meta, dict) or not isinstance(meta.get("rules"), list):
        raise EplbError(f"{path}: meta must be a JSON object with a 'rules' list")
    for k in ("phy2log_TLP", "counts_TLE"):
        if arrays[k].ndim != 3 or arrays[k].dtype.kind not in "iu":
            raise EplbError(f"{path}: {k} must be whole numbers [T, L, *], got dtype {arrays[k].dtype} "
                            f"and shape {arrays[k].shape}")
    T, L, P = arrays["phy2log_TLP"].shape
    R = len(meta["rules"])
    want = {"weights_TLP": (T, L, P), "window_T": (T,), "decided_T": (T,), "applied_T": (T,), "moves_T": (T,),
            "rounds_T": (T,), "counts_TLE": (T, L, arrays["counts_TLE"].shape[-1])}
    for k in arrays:
        if k.endswith("_imbalance_RTL") or k.endswith("_seconds_RTL"):
            want[k] = (R, T, L)
        elif k.endswith("_balancedness_RT"):
            want[k] = (R, T)
    bad = [f"{k} {arrays[k].shape} (expected {shape})" for k, shape in want.items() if arrays[k].shape != shape]
    if bad:
        raise EplbError(f"{path}: arrays disagree in shape: {'; '.join(bad)}")
    return arrays, meta
