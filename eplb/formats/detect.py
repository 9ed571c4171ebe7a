"""Read any supported trace file, detected by content rather than by file name.

`load_trace(path)` reads one file; `load_history(paths)` stacks the windows of several.
- eplb native `.npz` (zip with `counts`, `layer_ids`, `meta`; eplb.formats.native)
- plain NumPy `.npy` array [L, E] or [T, L, E] (layer ids 0..L-1)
- SGLang expert-distribution JSON or torch `.pt` (`logical_count`)
- TensorRT-LLM expert-statistic directory (`meta_info.json` + `rank*.safetensors`)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eplb.core.files import as_path, check_archive, check_npy, input_file, parse_json, read_bytes
from eplb.core.trace import Trace, default_meta
from eplb.errors import EplbError, reason, shown
from eplb.formats.native import read_npz
from eplb.formats.sglang import read_json, read_pt
from eplb.formats.trtllm import is_expert_statistic_dir, read_expert_statistic

_ZIP = b"PK\x03\x04"
_NPY = b"\x93NUMPY"


def _read_npy(path: Path) -> Trace:
    header = check_npy(path)  # shape, size and truncation checked before anything is allocated
    if len(header.shape) not in (2, 3):
        raise EplbError(f"{path}: a .npy trace must be [layers, experts] or [windows, layers, experts], "
                        f"got shape {header.shape}")
    if 0 in header.shape:  # checked before arange(L) below: shape (10**9, 0) holds nothing but asks a lot
        raise EplbError(f"{path}: the array has shape {header.shape}, which holds no counts")
    if header.shape[-1] == 1:
        # [N, L, 1] is what top-1 expert ids of N tokens look like; as counts it is one expert.
        raise EplbError(f"{path}: shape {header.shape} has one expert per layer, which is nothing to balance; "
                        f"a .npy trace holds counts [windows, layers, experts]. Per-token expert ids "
                        f"[tokens, layers, top_k] are not counts: count them per expert first "
                        f"(np.bincount per layer) or collect with eplb.runtime.collect")
    try:
        a = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise EplbError(f"{path}: not a readable .npy array ({reason(exc)})") from None
    if a.ndim == 2:
        a = a[None]
    elif _looks_like_token_ids(a):
        raise EplbError(f"{path}: shape {a.shape} looks like per-token expert ids [tokens, layers, top_k], not counts "
                        f"[windows, layers, experts]: every row holds {a.shape[2]} distinct ids, and the layers of "
                        f"one window route different token totals (counts of one window agree across layers): "
                        f"count them per expert first (np.bincount per layer), or, if these are counts, save them "
                        f"with eplb.save_trace as an .npz")
    # A bare array says nothing of the model: layer ids 0..L-1 are assumed, and the hidden-layer
    # count is unknown; `layer_ids_assumed` lets exports say so (eplb plan --layer-ids).
    meta = default_meta(a.shape[1], a.shape[2], num_hidden_layers=None, source=f"npy: {path.name}",
                        layer_ids_assumed=True)
    try:
        return Trace(a, np.arange(a.shape[1]), meta)
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None


MAX_TOP_K = 32
"""Most experts per token of any model eplb knows (most pick 8): a wider last axis is experts."""


def _looks_like_token_ids(a_NLK: np.ndarray) -> bool:
    """True for what per-token top-k ids [N, L, K] look like and counts [T, L, E] do not: small
    integers, K distinct ids in every row, and per-row totals that differ across layers (every
    token passes every MoE layer, so a window's counts sum to the same total in each layer)."""
    N, L, K = a_NLK.shape
    if a_NLK.dtype.kind not in "iu" or not 2 <= K <= MAX_TOP_K or L < 2:
        return False
    sorted_NLK = np.sort(a_NLK, axis=2)
    if (sorted_NLK[:, :, 1:] == sorted_NLK[:, :, :-1]).any():
        return False
    total_NL = a_NLK.sum(axis=2, dtype=np.float64)
    return bool((total_NL != total_NL[:, :1]).any())


def load_trace(path: str | Path) -> Trace:
    """Read any supported trace file (see the module docstring), detected by content; a trace
    whose counts are all zero is refused (there is nothing to balance or score)."""
    trace = _load(path)
    _check_tokens(trace, str(path))
    return trace


def _check_tokens(trace: Trace, source: str) -> None:
    if not trace.counts_TLE.any():  # scored, it would look perfectly balanced (1.0000)
        raise EplbError(f"{source}: every count is zero (no tokens recorded): there is nothing to balance or score; "
                        f"check the collector, or record windows with traffic")


def _load(path) -> Trace:
    path = as_path(path, "trace file")
    if path.is_dir():
        if is_expert_statistic_dir(path):
            return read_expert_statistic(path)
        raise EplbError(f"trace path {str(path)!r} is a folder but not a TensorRT-LLM expert statistic "
                        f"dump (meta_info.json + rank*.safetensors)")
    input_file(path, "trace file")
    with open(path, "rb") as f:
        head = f.read(4096)
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100_000_000:
        # safetensors: 8-byte header length, then a JSON header. One rank file alone is part of a
        # TensorRT-LLM dump; the counts need every rank's file and meta_info.json.
        raise EplbError(f"{path}: a single safetensors file; pass the TensorRT-LLM expert statistic "
                        f"directory ({str(path.parent)!r}) so all ranks and meta_info.json are read")
    if head.startswith(_NPY):
        return _read_npy(path)
    if head.startswith(_ZIP):
        names = check_archive(path, "the zip archive (.npz / .pt)", crc=False)  # each reader checks its CRCs
        if "counts.npy" in names:
            return read_npz(path)
        if any(n.endswith("data.pkl") or "/data/" in n for n in names):
            return read_pt(path)
        raise EplbError(f"{path}: zip archive is neither an eplb .npz trace nor a torch .pt file")
    if head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] in (b"{", b"[") or head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        # JSON, after a byte-order mark; a UTF-16 one is refused by parse_json with the fix
        return read_json(path, parse_json(read_bytes(path, "trace file"), str(path)))
    raise EplbError(
        f"{path}: unknown trace format; expected an eplb .npz, a .npy [L, E] / [T, L, E] array, "
        f"SGLang expert-distribution JSON / .pt, or a TensorRT-LLM expert statistic directory"
    )


def _ids(layer_ids) -> str:
    """Layer ids for a message: all of them when few, else the first and last three."""
    ids = [int(i) for i in layer_ids]
    if len(ids) <= 8:
        return f"{ids} ({len(ids)} layers)"
    return f"[{', '.join(map(str, ids[:3]))}, ..., {', '.join(map(str, ids[-3:]))}] ({len(ids)} layers)"


def load_history(paths) -> Trace:
    """Read several trace files of one model and stack their windows in the given order."""
    if isinstance(paths, (str, bytes, Path)) or not hasattr(paths, "__iter__"):
        # A string would be read as its characters' file names.
        raise EplbError(f"load_history needs a list of trace paths, got {type(paths).__name__} {shown(paths)}: "
                        f"load_history([path]) or load_trace(path) for one file")
    paths = list(paths)
    if not paths:
        raise EplbError("no trace files given")
    traces = [_load(p) for p in paths]
    first = traces[0]
    for p, t in zip(paths[1:], traces[1:]):
        if t.num_logical_experts != first.num_logical_experts:
            raise EplbError(f"{p}: {t.num_logical_experts} logical experts but {paths[0]} has "
                            f"{first.num_logical_experts}: traces of one model are needed")
        if not np.array_equal(t.layer_ids, first.layer_ids):
            raise EplbError(f"{p}: MoE layer ids {_ids(t.layer_ids)} but {paths[0]} has {_ids(first.layer_ids)}: "
                            f"the windows of one history must record the same layers")
        # Model facts must agree (a missing value, e.g. an SGLang dump, defers to the others).
        for key in ("num_expert_groups", "top_k"):
            a, b = first.meta.get(key), t.meta.get(key)
            if a is not None and b is not None and a != b:
                raise EplbError(f"{p}: {key} = {b} but {paths[0]} says {a}: traces of one model are needed")
    if len(traces) == 1:
        _check_tokens(first, str(paths[0]))
        return first
    meta = dict(first.meta)
    for key in ("num_expert_groups", "top_k"):
        if meta.get(key) is None:
            meta[key] = next((t.meta[key] for t in traces if t.meta.get(key) is not None), None)
    synthetic = [bool(t.meta["synthetic"]) for t in traces]
    if any(synthetic) and not all(synthetic):
        # One history, one provenance: `synthetic` cannot describe a mix, and figures planned on
        # one would be reported as neither real nor synthetic.
        fake = [str(p) for p, s in zip(paths, synthetic) if s]
        real = [str(p) for p, s in zip(paths, synthetic) if not s]
        raise EplbError(f"synthetic trace(s) {', '.join(fake)} and recorded trace(s) {', '.join(real)} given as one "
                        f"history: plan on real traffic or on synthetic traffic, not a mix (to study a mix on "
                        f"purpose, build one eplb.Trace and say so in its meta)")
    meta["source"] = "history of: " + ", ".join(str(p) for p in paths)
    meta["synthetic"] = all(synthetic)
    try:
        history = Trace(np.concatenate([t.counts_TLE for t in traces]), first.layer_ids, meta)
    except EplbError as exc:  # each file was valid alone; together, e.g., their counts sum past 2**62
        raise EplbError(f"history of {', '.join(str(p) for p in paths)}: {exc}") from None
    _check_tokens(history, f"history of {', '.join(str(p) for p in paths)}")
    return history
