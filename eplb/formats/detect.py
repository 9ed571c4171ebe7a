"""Read any supported trace file, detected by content rather than by file name.

- eplb native `.npz` (zip with `counts`, `layer_ids`, `meta`)
- plain NumPy `.npy` array [L, E] or [T, L, E] (layer ids 0..L-1)
- SGLang expert-distribution JSON or torch `.pt` (`logical_count`)
- TensorRT-LLM expert-statistic directory (`meta_info.json` + `rank*.safetensors`)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eplb.errors import EplbError
from eplb.trace import Trace, default_meta

_ZIP = b"PK\x03\x04"
_NPY = b"\x93NUMPY"


def _read_npy(path: Path) -> Trace:
    try:
        a = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise EplbError(f"{path}: cannot read without pickle ({exc})") from None
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3:
        raise EplbError(f"{path}: a .npy trace must be [layers, experts] or [windows, layers, experts], got shape {a.shape}")
    meta = default_meta(a.shape[1], a.shape[2], source=f"npy: {path.name}")
    try:
        return Trace(a, np.arange(a.shape[1]), meta)
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None


def read_trace(path) -> Trace:
    path = Path(path)
    if not path.exists():
        raise EplbError(f"trace file {str(path)!r} does not exist")
    if path.is_dir():
        from eplb.formats.trtllm import is_expert_statistic_dir, read_expert_statistic

        if is_expert_statistic_dir(path):
            return read_expert_statistic(path)
        raise EplbError(f"trace path {str(path)!r} is a directory but not a TensorRT-LLM expert statistic "
                        f"dump (meta_info.json + rank*.safetensors)")
    if not path.is_file():
        raise EplbError(f"trace path {str(path)!r} is not a file")
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100_000_000:
        # safetensors: 8-byte header length, then a JSON header. One rank file alone is part of a
        # TensorRT-LLM dump; the counts need every rank's file and meta_info.json.
        raise EplbError(f"{path}: a single safetensors file; pass the TensorRT-LLM expert statistic "
                        f"directory ({str(path.parent)!r}) so all ranks and meta_info.json are read")
    if head.startswith(_NPY):
        return _read_npy(path)
    if head.startswith(_ZIP):
        import zipfile

        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile as exc:
            raise EplbError(f"{path}: starts like a zip (.npz / .pt) but is corrupt ({exc})") from None
        if "counts.npy" in names:
            return Trace.load_npz(path)
        if any(n.endswith("data.pkl") or "/data/" in n for n in names):
            from eplb.formats.sglang import read_pt

            return read_pt(path)
        raise EplbError(f"{path}: zip archive is neither an eplb .npz trace nor a torch .pt file")
    if head.lstrip()[:1] in (b"{", b"["):
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EplbError(f"{path}: looks like JSON but does not parse ({exc})") from None
        from eplb.formats.sglang import read_json

        return read_json(path, data)
    raise EplbError(
        f"{path}: unknown trace format; expected an eplb .npz, a .npy [L, E] / [T, L, E] array, "
        f"SGLang expert-distribution JSON / .pt, or a TensorRT-LLM expert statistic directory"
    )
