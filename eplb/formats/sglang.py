"""SGLang expert-distribution statistics (import) and `--init-expert-location` (export).

Legend: H = hidden layers (dense and MoE), L = MoE layers, E = logical experts, P = slots.

Import: SGLang's recorder (stat mode) dumps `{"logical_count": ...}` as JSON or a torch `.pt`
file (`{"rank", "logical_count", "average_utilization_rate_over_window"}`): either [H, E]
totals or [steps, H, E]. Dense layers appear as all-zero rows; they are dropped on import and
the MoE layers' hidden-layer ids kept in layer_ids.

Export: `--init-expert-location FILE.json` takes `{"physical_to_logical_map": [H][P]}` and
nothing else (SGLang passes the JSON's keys as keyword arguments to
`ExpertLocationMetadata.init_by_mapping`, so any extra key makes it fail). It needs a row for
every hidden layer (`num_hidden_layers` rows); dense layers get the trivial row
`p % E`, which is what SGLang's own `init_trivial` fills every layer with. Launch SGLang with
`--ep-num-redundant-experts P-E` so its slot count matches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from eplb.core.files import as_path, check_input_size
from eplb.core.outputs import atomic_output
from eplb.core.placement import Placement
from eplb.core.trace import Trace, default_meta
from eplb.errors import EplbError, number_array, whole_array, whole_number
from eplb.formats.native import read_json_file
from eplb.formats.torchfile import file_tensor, load_torch


def trace_from_logical_count(logical_count: Any, *, source: str) -> Trace:
    """Build a Trace from SGLang's `logical_count` ([layers, E] or [steps, layers, E])."""
    c = number_array(f"{source}: logical_count", logical_count).astype(np.float64)
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3:
        raise EplbError(f"{source}: logical_count must be [layers, experts] or [steps, layers, experts], "
                        f"got shape {c.shape}")
    if not np.all(np.isfinite(c)) or (c.size and c.min() < 0):
        raise EplbError(f"{source}: logical_count holds negative, NaN or infinite values")
    # Counts are whole tokens; rounding fractions (or wrapping values past int64) would change
    # the data without saying so.
    if c.size and c.max() >= 2.0**62:
        raise EplbError(f"{source}: logical_count holds {c.max():g}, too large for a token count")
    if not np.array_equal(c, np.rint(c)):
        idx = tuple(int(i) for i in np.argwhere(c != np.rint(c))[0])
        raise EplbError(f"{source}: logical_count must be whole token counts, got {float(c[idx]):g} at "
                        f"[step, layer, expert] {list(idx)}")
    moe = np.flatnonzero(c.sum(axis=(0, 2)) > 0)
    if moe.size == 0:
        raise EplbError(f"{source}: every layer of logical_count is zero (no tokens recorded)")
    meta = default_meta(c.shape[1], c.shape[2], source=f"sglang expert-distribution recorder: {Path(source).name}")
    return Trace(c[:, moe].astype(np.int64), moe.astype(np.int64), meta)


def read_json(path: Path, data: Any | None = None) -> Trace:
    """A Trace from SGLang's expert-distribution JSON (`data`: the parsed file, if read already)."""
    if data is None:
        data = read_json_file(path, "SGLang expert-distribution file")
    if not isinstance(data, dict) or "logical_count" not in data:
        raise EplbError(f"{path}: not SGLang expert-distribution JSON (no 'logical_count' key)")
    return trace_from_logical_count(data["logical_count"], source=str(path))


def read_pt(path: Path) -> Trace:
    """A Trace from SGLang's expert-distribution `.pt` dump (checked and loaded by load_torch)."""
    obj = load_torch(path, "SGLang expert-distribution dump")
    if not isinstance(obj, dict) or "logical_count" not in obj:
        raise EplbError(f"{path}: torch file holds no 'logical_count' (not an SGLang expert-distribution dump)")
    lc = obj["logical_count"]
    if type(lc).__module__.startswith("torch"):
        lc = file_tensor(path, "logical_count", lc)
    return trace_from_logical_count(lc, source=str(path))


# Export: --init-expert-location ---------------------------------------------------------------

def sglang_map(placement, num_hidden_layers: int | None = None) -> np.ndarray:
    """physical_to_logical_map [H, P] for SGLang: MoE rows from the placement, dense rows trivial."""
    ids = placement.layer_ids
    H = int(ids.max()) + 1 if num_hidden_layers is None else whole_number("num_hidden_layers", num_hidden_layers, 1)
    if H <= int(ids.max()):
        raise EplbError(f"num_hidden_layers ({H}) must exceed the largest MoE layer id ({int(ids.max())})")
    P, E = placement.num_slots, placement.num_logical_experts
    check_input_size(f"num_hidden_layers {H}" if num_hidden_layers is not None else
                     f"largest MoE layer id {int(ids.max())}", 8 * H * P,
                     f"the SGLang map of {H} rows (one per hidden layer) x {P} slots")
    out_HP = np.tile(np.arange(P, dtype=np.int64) % E, (H, 1))
    out_HP[ids] = placement.phy2log_LP
    return out_HP


def write_sglang(placement, path, num_hidden_layers: int | None = None) -> Path:
    path = as_path(path, "the file path")
    map_HP = sglang_map(placement, num_hidden_layers)
    # One row per line: readable and diff-friendly, still plain JSON. Written row by row: the
    # whole map as Python lists and text would take 5x the array.
    with atomic_output(path, what="the SGLang placement") as f:
        f.write(b'{"physical_to_logical_map": [\n')
        for h, row in enumerate(map_HP):
            f.write(f"  {json.dumps(row.tolist())}{',' if h + 1 < len(map_HP) else ''}\n".encode())
        f.write(b"]}\n")
    return path


def read_sglang(path, *, num_gpus: int, layer_ids=None, num_logical_experts: int | None = None,
                num_nodes: int = 1):
    """A Placement from an `--init-expert-location` JSON; layer_ids picks the MoE rows."""
    path = as_path(path, "the file path")
    d = read_json_file(path, "SGLang expert-location file")
    if not isinstance(d, dict) or "physical_to_logical_map" not in d:
        raise EplbError(f"{path}: no physical_to_logical_map (not an SGLang --init-expert-location file)")
    # whole_array, not asarray(dtype=int64): that reads expert 2.7 as 2.
    phy2log_HP = whole_array(f"{path}: physical_to_logical_map", d["physical_to_logical_map"])
    if phy2log_HP.ndim != 2 or 0 in phy2log_HP.shape:
        raise EplbError(f"{path}: physical_to_logical_map must be 2-D [hidden layers, slots] and not empty, "
                        f"got shape {phy2log_HP.shape}")
    if layer_ids is None:
        ids = np.arange(phy2log_HP.shape[0])
    else:
        ids = whole_array("layer_ids (hidden-layer indices)", layer_ids)
        if ids.ndim != 1:
            raise EplbError(f"layer_ids must be a list of whole hidden-layer indices, got {layer_ids!r}")
    if ids.size and (ids.min() < 0 or ids.max() >= phy2log_HP.shape[0]):
        raise EplbError(f"{path}: layer ids {ids.tolist()} outside the file's {phy2log_HP.shape[0]} rows")
    E = (whole_number("num_logical_experts", num_logical_experts, 1) if num_logical_experts is not None
         else int(phy2log_HP.max()) + 1)
    try:
        return Placement(phy2log_HP[ids], num_gpus, E, num_nodes, ids, planner="sglang")
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None
