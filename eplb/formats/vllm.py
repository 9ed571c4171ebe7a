"""vLLM's EPLB state as a `.pt` file: the three mapping tensors of `EplbState`.

Legend: L = MoE layers, E = logical experts, P = physical slots, X = P - E + 1.

vLLM keeps, per MoE layer (its layer axis counts MoE layers only):
- `physical_to_logical_map`  int64 [L, P]
- `logical_to_physical_map`  int64 [L, E, X], padded with -1 ("no mapping"); vLLM documents
  X = num_redundant_experts + 1 = P - E + 1
- `logical_replica_count`    int64 [L, E]
The file is a dict of tensors written with `torch.save` and read with
`torch.load(weights_only=True)`. eplb adds `layer_ids` [L], `num_gpus` and `num_nodes` (0-d
tensors) so the file round-trips; vLLM code that indexes the three maps ignores them.
vLLM has no command-line option that loads this file: it is for code that sets the state
(e.g. a plugin or a patched `EplbState.build`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from eplb.core.files import as_path
from eplb.core.outputs import write_bytes
from eplb.core.placement import Placement
from eplb.errors import EplbError, whole_array, whole_number
from eplb.formats.deepseek import from_deepseek, to_deepseek
from eplb.formats.torchfile import file_tensor, load_torch

KEYS = ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count")


def vllm_maps(placement: Placement) -> dict[str, np.ndarray]:
    """The three vLLM maps as int64 numpy arrays (log2phy padded to P - E + 1 columns)."""
    P, E = placement.num_slots, placement.num_logical_experts
    phy, l2p, cnt = to_deepseek(placement, pad_to=P - E + 1)
    return dict(zip(KEYS, (phy, l2p, cnt)))


def write_vllm(placement: Placement, path: str | Path) -> Path:
    import torch  # .pt IO is one of the few places torch is needed

    path = as_path(path, "the file path")
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in vllm_maps(placement).items()}
    state["layer_ids"] = torch.from_numpy(np.array(placement.layer_ids, dtype=np.int64))
    state["num_gpus"] = torch.tensor(placement.num_gpus, dtype=torch.int64)
    state["num_nodes"] = torch.tensor(placement.num_nodes, dtype=torch.int64)
    # Serialised in memory, then written atomically: torch.save on a path raises RuntimeError
    # for an unwritable one, and a failed write must not leave half a zip.
    buf = io.BytesIO()
    torch.save(state, buf)
    write_bytes(path, buf.getvalue(), what="the vLLM placement")
    return path


def read_vllm(path: str | Path, *, num_gpus: int | None = None, num_nodes: int | None = None,
              layer_ids=None) -> Placement:
    obj = load_torch(path, "vLLM placement file")
    if not isinstance(obj, dict) or any(k not in obj for k in KEYS):
        have = sorted(map(str, obj))[:12] if isinstance(obj, dict) else type(obj).__name__
        raise EplbError(f"{path}: a vLLM placement needs tensors {', '.join(KEYS)}; found {have}")
    obj = dict(obj)
    for key in (*KEYS, "layer_ids", "num_gpus", "num_nodes"):
        if key not in obj:
            continue
        a = file_tensor(path, key, obj[key])
        if a.dtype.kind not in "iu":
            raise EplbError(f"{path}: {key} must be an integer tensor, got dtype {obj[key].dtype}")
        obj[key] = a

    def scalar(key: str, given):
        if given is not None:
            return whole_number(key, given, 1)
        if key not in obj:
            raise EplbError(f"{path}: no {key} in the file; pass {key}=...")
        if obj[key].size != 1:
            raise EplbError(f"{path}: {key} must be one number, got shape {obj[key].shape}")
        return whole_number(f"{path}: {key}", int(obj[key].reshape(())), 1)

    for key, ndim in zip(KEYS, (2, 3, 2)):
        if obj[key].ndim != ndim:
            raise EplbError(f"{path}: {key} must be {ndim}-D, got shape {obj[key].shape}")
    ids = layer_ids if layer_ids is not None else obj.get("layer_ids")
    ids = None if ids is None else whole_array("layer_ids", ids)
    try:
        return from_deepseek(obj[KEYS[0]], obj[KEYS[1]], obj[KEYS[2]],
                             num_gpus=scalar("num_gpus", num_gpus), num_nodes=scalar("num_nodes", num_nodes),
                             num_logical_experts=int(obj[KEYS[2]].shape[-1]), layer_ids=ids, planner="vllm")
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None
