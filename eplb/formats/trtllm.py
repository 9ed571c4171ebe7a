"""TensorRT-LLM: `load_balancer` YAML (export) and expert-statistic dumps (import).

Legend: T = iterations (windows), L = MoE layers, E = logical experts, P = slots.

Export: the file given as `moe_config.load_balancer` (TensorRT-LLM's MoeLoadBalancerConfig):
    num_slots: 288
    initial_global_assignments:
      3: [138, 81, 60, ...]      # hidden-layer index -> logical expert of each of the P slots
    layer_updates_per_iter: 0    # 0 = static placement
Every run of P // G consecutive slots belongs to one rank, as in eplb. The file names no GPU
count (it comes from the deployment's EP size), so reading it back needs `num_gpus`.

Import: the directory TensorRT-LLM writes when `EXPERT_STATISTIC_ITER_RANGE=a-b` and
`EXPERT_STATISTIC_PATH=DIR` are set (tensorrt_llm/_torch/expert_statistic.py):
    DIR/meta_info.json        {"num_experts": E, "num_experts_per_token": K}
    DIR/rank{r}.safetensors   one int64 [E] bincount per key "{iteration}_{layer}"
Ranks are summed; each iteration becomes a window, each layer id a MoE layer. `*_raw` files
(per-token dumps) are skipped. safetensors files are parsed here (8-byte header length,
JSON header, raw little-endian data), so no extra dependency and nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from eplb.core.files import (
    as_path,
    check_input_size,
    format_size,
    input_file,
    parse_json,
    parse_yaml,
    read_bytes,
    read_json,
)
from eplb.core.outputs import write_bytes, write_text
from eplb.core.placement import Placement
from eplb.core.trace import MAX_COUNT, Trace, default_meta
from eplb.errors import EplbError, is_whole, shown, whole_number

_ST_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1",
              "F64": "<f8", "F32": "<f4", "F16": "<f2"}


# Export ---------------------------------------------------------------------------------------

def write_trtllm(placement: Placement, path: str | Path, *, layer_updates_per_iter: int = 0) -> Path:
    """Write the `load_balancer` YAML; one flow-style list per layer keeps it diff-friendly."""
    path = as_path(path, "the file path")
    lines = [f"num_slots: {placement.num_slots}", "initial_global_assignments:"]
    for layer_id, row in zip(placement.layer_ids.tolist(), placement.phy2log_LP.tolist()):
        lines.append(f"  {layer_id}: [{', '.join(str(e) for e in row)}]")
    lines.append(f"layer_updates_per_iter: {int(layer_updates_per_iter)}")
    write_text(path, "\n".join(lines) + "\n", what="the TensorRT-LLM placement")
    return path


def read_trtllm(path: str | Path, *, num_gpus: int, num_logical_experts: int | None = None,
                num_nodes: int = 1) -> Placement:
    path = input_file(path, "TensorRT-LLM load-balancer file")
    d = parse_yaml(read_bytes(path, "TensorRT-LLM load-balancer file"), str(path))
    if not isinstance(d, dict) or "initial_global_assignments" not in d:
        raise EplbError(f"{path}: no initial_global_assignments (not a static TensorRT-LLM load_balancer file)")
    assign = d["initial_global_assignments"]
    if not isinstance(assign, dict) or not assign:
        raise EplbError(f"{path}: initial_global_assignments must map layer index -> list of expert ids")
    layer_ids, rows = [], []
    for key, row in assign.items():
        layer = _whole(key, path, "a layer index")
        if not isinstance(row, list):  # "012" would iterate as experts 0, 1, 2
            raise EplbError(f"{path}: layer {layer} must list its slots' expert ids as [e0, e1, ...], got "
                            f"{type(row).__name__} {shown(row)}")
        if not row:
            raise EplbError(f"{path}: layer {layer} lists no slots: every layer needs an expert id per slot")
        layer_ids.append(layer)
        rows.append([_whole(e, path, f"an expert id (layer {layer})") for e in row])
    if len(set(layer_ids)) != len(layer_ids):  # 3 and "3" are one layer
        seen: set[int] = set()
        dup = next(i for i in layer_ids if i in seen or seen.add(i))
        raise EplbError(f"{path}: layer {dup} is listed twice in initial_global_assignments")
    order = sorted(range(len(layer_ids)), key=layer_ids.__getitem__)
    layer_ids = [layer_ids[i] for i in order]
    rows = [rows[i] for i in order]
    if len({len(r) for r in rows}) != 1:
        raise EplbError(f"{path}: layers list different numbers of slots: {sorted({len(r) for r in rows})}")
    num_slots = d.get("num_slots")
    if num_slots is not None:
        num_slots = whole_number(f"{path}: num_slots", num_slots, None)
    if num_slots is not None and num_slots != len(rows[0]):
        raise EplbError(f"{path}: num_slots is {num_slots} but each layer lists {len(rows[0])} slots")
    phy = np.array(rows, dtype=np.int64)
    E = (whole_number("num_logical_experts", num_logical_experts, 1) if num_logical_experts is not None
         else int(phy.max()) + 1)
    try:
        return Placement(phy, num_gpus, E, num_nodes, np.array(layer_ids, dtype=np.int64), planner="trtllm")
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None


_ASCII_WHOLE = re.compile(r"[0-9]+")


def _whole(x, path, what: str) -> int:
    """A whole number of the YAML as an int: a quoted key "3" is layer 3, but "٣" (a digit of
    another script, which int() reads) and 3.7 are refused; int() would read 3.7 as 3."""
    if isinstance(x, str) and _ASCII_WHOLE.fullmatch(x.strip()):
        x = int(x.strip())
    if not is_whole(x) or abs(x) > 2**62:
        raise EplbError(f"{path}: initial_global_assignments must map layer indices to lists of expert ids, all "
                        f"whole numbers: got {shown(x)} as {what}")
    return int(x)


# Import of expert statistics ------------------------------------------------------------------

def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (no code runs, nothing unpickled)."""
    path = as_path(path, "the file path")
    raw = read_bytes(path, "safetensors file")
    if len(raw) < 8:
        raise EplbError(f"{path}: too short for a safetensors file")
    n = int.from_bytes(raw[:8], "little")
    if n <= 0 or 8 + n > len(raw):
        raise EplbError(f"{path}: bad safetensors header length {n}")
    try:
        header = parse_json(raw[8:8 + n], f"{path}: safetensors header")
    except EplbError as exc:
        raise EplbError(f"{exc} (not a safetensors file?)") from None
    if not isinstance(header, dict):
        raise EplbError(f"{path}: safetensors header must be a JSON object, got {type(header).__name__}")
    data = memoryview(raw)[8 + n:]
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
            start, stop = (whole_number("offset", x) for x in info["data_offsets"])
            shape = tuple(whole_number("dimension", s) for s in info["shape"])
        except (KeyError, TypeError, ValueError):  # EplbError is a ValueError: the entry is named below
            raise EplbError(f"{path}: tensor {key!r} has an unsupported or malformed header entry "
                            f"{repr(info)[:200]}") from None
        if not 0 <= start <= stop <= len(data) or (stop - start) != dtype.itemsize * math.prod(shape):
            raise EplbError(f"{path}: tensor {key!r} has data offsets that do not fit its shape {shape}")
        out[key] = np.frombuffer(data[start:stop], dtype=dtype).reshape(shape).copy()
    return out


def write_safetensors(tensors: dict[str, np.ndarray], path: str | Path) -> Path:
    """Write numpy arrays as a .safetensors file (the layout TensorRT-LLM's dumps use)."""
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for key, a in tensors.items():
        a = np.ascontiguousarray(a)
        code = names.get(a.dtype.newbyteorder("<").str if a.dtype.itemsize > 1 else a.dtype.str)
        if code is None:
            raise EplbError(f"cannot write dtype {a.dtype} to safetensors")
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[key] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header to 8 bytes
    path = as_path(path, "the file path")
    write_bytes(path, len(h).to_bytes(8, "little") + h + b"".join(blobs), what="the safetensors file")
    return path


_KEY = re.compile(r"^([0-9]+)_([0-9]+)$")  # \d would take digits of other scripts


def is_expert_statistic_dir(path: Path) -> bool:
    return path.is_dir() and (path / "meta_info.json").is_file() and any(_rank_files(path))


def _rank_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("rank*.safetensors") if not p.name.endswith("_raw.safetensors"))


def read_expert_statistic(path: str | Path) -> Trace:
    """A Trace [iterations, layers, E] from a TensorRT-LLM expert-statistic directory."""
    path = as_path(path, "the file path")
    info = read_json(path / "meta_info.json", "TensorRT-LLM meta_info.json")
    if not isinstance(info, dict) or "num_experts" not in info:
        raise EplbError(f"{path}/meta_info.json: no num_experts (not a TensorRT-LLM expert statistic dump)")
    E = whole_number(f"{path}/meta_info.json: num_experts", info["num_experts"], 1)
    files = _rank_files(path)
    if not files:
        raise EplbError(f"{path}: no rank*.safetensors files")
    size = sum(f.stat().st_size for f in files)
    check_input_size(path, size, f"{len(files)} rank files ({format_size(size)})")
    total: dict[tuple[int, int], np.ndarray] = {}
    bound: dict[tuple[int, int], float] = {}  # float64 sums: int64 ones could wrap unseen
    for f in files:
        for key, a in read_safetensors(f).items():
            m = _KEY.match(key)
            if not m:
                raise EplbError(f"{f}: tensor name {key!r} is not '<iteration>_<layer>'")
            if a.shape != (E,):
                raise EplbError(f"{f}: tensor {key!r} has shape {a.shape}, expected ({E},) "
                                f"(num_experts in meta_info.json)")
            if a.dtype.kind == "f" and not (np.all(np.isfinite(a)) and np.array_equal(a, np.rint(a))):
                bad = a[~(np.isfinite(a) & (a == np.rint(a)))][0]
                raise EplbError(f"{f}: tensor {key!r} holds {bad:g}; expert statistics are whole token counts")
            k = (int(m.group(1)), int(m.group(2)))
            bound[k] = bound.get(k, 0.0) + float(np.abs(a.astype(np.float64)).max(initial=0.0))
            if bound[k] > MAX_COUNT:
                raise EplbError(f"{f}: tensor {key!r}: counts summed over ranks reach {bound[k]:g}, more than "
                                f"2**62: not token counts")
            total[k] = total.get(k, 0) + a.astype(np.int64)
    iters = sorted({i for i, _ in total})
    layers = sorted({l for _, l in total})
    n_missing = len(iters) * len(layers) - len(total)
    if n_missing:
        i, l = next((i, l) for i in iters for l in layers if (i, l) not in total)
        raise EplbError(f"{path}: {n_missing} (iteration, layer) counts missing, e.g. iteration {i} layer {l}")
    counts_TLE = np.stack([np.stack([total[(i, l)] for l in layers]) for i in iters])
    meta = default_meta(max(layers) + 1, E, num_hidden_layers=None,
                        top_k=info.get("num_experts_per_token"),
                        source=f"tensorrt-llm expert statistic: {path.name} ({len(files)} ranks, "
                               f"iterations {iters[0]}..{iters[-1]})")
    meta["iterations"] = iters
    try:
        return Trace(counts_TLE, np.array(layers, dtype=np.int64), meta)
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None
