"""eplb's own files: traces (`.npz`) and placements (JSON), read and written.

Legend: T = time windows, L = MoE layers, E = logical experts, N = tokens, K = top-k, P = slots.

Trace `.npz` (schema in traces/README.md), read with `allow_pickle=False` (nothing in a trace
can execute code):
- `counts`    int64 [T, L, E]  token-slots routed to each logical expert per window and layer
- `layer_ids` int64 [L]        hidden-layer index of each MoE layer in the model
- `meta`      JSON text        model, num_hidden_layers, num_experts, top_k,
                               num_expert_groups, tokens_per_window, source, synthetic
- optional per-token data: `topk_ids` int16 [N, L, K] and `token_window` int32 [N].

Placement JSON: `Placement.to_dict()` (`physical_to_logical_map` [L][P], `layer_ids`,
`num_gpus`, `num_nodes`, `num_logical_experts`, optional `dispatch_weights`, planner, metrics).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from eplb.core.files import ZIP_ERRORS, as_path, load_npz, parse_json, read_json
from eplb.core.outputs import atomic_output, write_text
from eplb.core.placement import Placement
from eplb.core.trace import Trace
from eplb.errors import EplbError

TRACE_ARRAYS = ("counts", "layer_ids", "meta")
"""Arrays every trace `.npz` holds (plus the optional per-token `topk_ids`, `token_window`)."""


# Traces -----------------------------------------------------------------------------------------

def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write `trace` as eplb's `.npz` (compressed); returns the path."""
    if not isinstance(trace, Trace):
        raise EplbError(f"save_trace needs an eplb Trace, got {type(trace).__name__}")
    arrays = {
        "counts": np.asarray(trace.counts_TLE, dtype=np.int64),
        "layer_ids": np.asarray(trace.layer_ids, dtype=np.int64),
        "meta": np.array(json.dumps(trace.meta, sort_keys=True)),
    }
    if trace.topk_ids_NLK is not None:
        arrays["topk_ids"] = trace.topk_ids_NLK
        arrays["token_window"] = trace.token_window_N
    path = as_path(path, "the trace's path")
    with atomic_output(path, what="the trace") as f:
        np.savez_compressed(f, **arrays)
    return path


def read_npz(path: str | Path) -> Trace:
    """A Trace from eplb's `.npz` (no pickle); errors name the file and what is wrong.

    Every array's declared shape is checked against the input limit (eplb.core.files) first."""
    path = as_path(path, "the file path")
    arrays = load_npz(path)
    missing = [k for k in TRACE_ARRAYS if k not in arrays]
    if missing:
        raise EplbError(f"{path}: missing array(s) {', '.join(missing)}; see traces/README.md for the schema")
    if arrays["meta"].dtype.kind != "U" or arrays["meta"].ndim != 0:
        raise EplbError(f"{path}: meta must be one JSON string, got an array of dtype {arrays['meta'].dtype} "
                        f"and shape {arrays['meta'].shape}")
    meta = parse_json(str(arrays["meta"]).encode("utf-8"), f"{path}: meta")
    if not isinstance(meta, dict):
        raise EplbError(f"{path}: meta must be a JSON object, got {type(meta).__name__}")
    try:
        return Trace(arrays["counts"], arrays["layer_ids"], meta, arrays.get("topk_ids"), arrays.get("token_window"))
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None


# JSON and placements ----------------------------------------------------------------------------

def read_json_file(path: str | Path, what: str) -> Any:
    """Parse a JSON file, or raise EplbError naming the file (`what` says what it should be);
    bounded by the input limit and MAX_JSON_DEPTH (eplb.core.files.read_json)."""
    return read_json(path, what)


def save_placement(placement: Placement, path: str | Path) -> Path:
    """Write `placement` as eplb's JSON (lossless: weights, layer ids, planner, metrics); returns the path."""
    if not isinstance(placement, Placement):
        raise EplbError(f"save_placement needs an eplb Placement, got {type(placement).__name__}")
    path = as_path(path, "the placement's path")
    write_text(path, json.dumps(placement.to_dict()) + "\n", what="the placement")
    return path


def load_placement(path: str | Path) -> Placement:
    """Read eplb's placement JSON; an engine export (SGLang, vLLM, TensorRT-LLM) is named as such."""
    path = as_path(path, "placement file")
    fmt = _engine_format(path)
    if fmt is None:
        d = read_json_file(path, "placement file")
        if isinstance(d, dict) and set(d) == {"physical_to_logical_map"}:
            fmt = "sglang"  # SGLang's --init-expert-location file holds this key and nothing else
        else:
            return Placement.from_dict(d, source=str(path))
    if fmt in ("npz", "zip"):
        what = "an eplb trace (.npz)" if fmt == "npz" else "a zip archive"
        hint = ": did you swap the trace and the placement?" if fmt == "npz" else ""
        raise EplbError(f"{path}: {what}, not an eplb placement file (JSON written by `eplb plan -o`){hint}")
    name = {"vllm": "torch .pt file (vLLM's", "trtllm": "TensorRT-LLM YAML (TensorRT-LLM's",
            "sglang": "SGLang JSON (SGLang's"}[fmt] + " format)"
    extra = "" if fmt == "vllm" else ", num_gpus=G"
    raise EplbError(f"{path}: a {name}, not an eplb placement file: if it is a placement export, read it with "
                    f"eplb.formats.export.read_placement(path, '{fmt}'{extra}); eplb commands take the "
                    f"file `eplb plan --format eplb` writes")


def _engine_format(path: Path) -> str | None:
    """Which non-JSON file a placement path looks like: "vllm" (a torch .pt zip), "trtllm",
    "npz" (an eplb trace), "zip" (another archive), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None  # read_json_file says what is wrong with the path
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except ZIP_ERRORS:
            return "zip"
        if "counts.npy" in names:
            return "npz"
        return "vllm" if any(n.endswith("data.pkl") for n in names) else "zip"
    if head.lstrip().startswith((b"num_slots:", b"initial_global_assignments:")):
        return "trtllm"
    return None
