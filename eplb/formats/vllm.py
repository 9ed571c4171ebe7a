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

from pathlib import Path

import numpy as np

from eplb.errors import EplbError
from eplb.formats.deepseek import from_deepseek, to_deepseek
from eplb.placement import Placement

KEYS = ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count")


def vllm_maps(placement: Placement) -> dict[str, np.ndarray]:
    """The three vLLM maps as int64 numpy arrays (log2phy padded to P - E + 1 columns)."""
    P, E = placement.num_slots, placement.num_logical_experts
    phy, l2p, cnt = to_deepseek(placement, pad_to=P - E + 1)
    return dict(zip(KEYS, (phy, l2p, cnt)))


def write_vllm(placement: Placement, path: str | Path) -> Path:
    import torch  # .pt IO is one of the few places torch is needed

    path = Path(path)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in vllm_maps(placement).items()}
    state["layer_ids"] = torch.from_numpy(np.array(placement.layer_ids, dtype=np.int64))
    state["num_gpus"] = torch.tensor(placement.num_gpus, dtype=torch.int64)
    state["num_nodes"] = torch.tensor(placement.num_nodes, dtype=torch.int64)
    # Open the file here: a missing folder or a folder as path is then an OSError naming the
    # path (one line from the CLI), where torch.save(state, path) raises a RuntimeError.
    with open(path, "wb") as f:
        torch.save(state, f)
    return path


def read_vllm(path: str | Path, *, num_gpus: int | None = None, num_nodes: int | None = None,
              layer_ids=None) -> Placement:
    import torch

    path = Path(path)
    if not path.is_file():
        raise EplbError(f"vLLM placement file {str(path)!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unsafe or corrupt files
        raise EplbError(f"{path}: cannot load as a weights-only torch file ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or any(k not in obj for k in KEYS):
        have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise EplbError(f"{path}: a vLLM placement needs tensors {', '.join(KEYS)}; found {have}")

    def scalar(key: str, given):
        if given is not None:
            return int(given)
        if key not in obj:
            raise EplbError(f"{path}: no {key} in the file; pass {key}=...")
        return int(obj[key])

    ids = layer_ids if layer_ids is not None else obj.get("layer_ids")
    try:
        return from_deepseek(obj[KEYS[0]], obj[KEYS[1]], obj[KEYS[2]],
                             num_gpus=scalar("num_gpus", num_gpus), num_nodes=scalar("num_nodes", num_nodes),
                             num_logical_experts=int(obj[KEYS[2]].shape[-1]),
                             layer_ids=None if ids is None else np.asarray(ids, dtype=np.int64), planner="vllm")
    except EplbError as exc:
        raise EplbError(f"{path}: {exc}") from None
