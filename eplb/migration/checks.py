"""Checks and kernel argument types at the boundary of the migration package.

Legend: L = MoE layers, E = logical experts, G = GPUs, P = physical slots (a multiple of G).

The compiled kernels index arrays by expert and slot ids without bounds checks, so every
public entry point runs these first: a bad map fails here, with its name and the offending
value, instead of corrupting memory there. Then `kernel_ints` hands the kernels one
argument type per array.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError, whole_number


def check_count(name: str, v, lo: int = 1) -> int:
    """v as an int, if it is a whole number >= lo (bools refused: True is no count)."""
    return whole_number(name, v, lo)


def check_maps(num_gpus: int, num_logical_experts: int, **maps) -> tuple[int, int]:
    """Validate [L, P] expert maps (keyword = name in the error): 2-D, whole numbers, one shape,
    P a multiple of num_gpus, entries in -1..num_logical_experts-1 (-1 = empty slot). Returns (L, P)."""
    if isinstance(num_gpus, bool) or int(num_gpus) != num_gpus or num_gpus < 1:
        raise EplbError(f"num_gpus must be a positive whole number, got {num_gpus!r}")
    if (isinstance(num_logical_experts, bool) or int(num_logical_experts) != num_logical_experts
            or num_logical_experts < 1):
        raise EplbError(f"num_logical_experts must be a positive whole number, got {num_logical_experts!r}")
    shape = None
    for name, m in maps.items():
        a = np.asarray(m)
        if a.ndim != 2 or a.shape[1] == 0:
            raise EplbError(f"{name} must be a [layers, slots] map, got shape {a.shape}")
        if a.dtype.kind not in "iu" and not (a.dtype.kind == "f" and np.array_equal(a, np.round(a))):
            raise EplbError(f"{name} must hold whole expert ids, got dtype {a.dtype}")
        if shape is not None and a.shape != shape:
            raise EplbError(f"{name} has shape {a.shape} but {next(iter(maps))} has {shape}: "
                            f"maps of the same layers and slots are needed")
        shape = a.shape
        if a.shape[1] % num_gpus:
            raise EplbError(f"{name} has {a.shape[1]} slots, which do not split evenly over {num_gpus} GPUs")
        bad = (a < -1) | (a >= num_logical_experts)
        if bad.any():
            l, p = np.argwhere(bad)[0]
            raise EplbError(f"{name} holds expert {a[l, p]} in slot {p} of layer index {l}: expert ids are "
                            f"0..{num_logical_experts - 1} (-1 = empty slot)")
    return shape


def check_nodes(num_gpus: int, num_nodes) -> int:
    """num_nodes as an int, if it is a positive whole number that splits the GPUs evenly (the
    compiled GPU assignment fills num_nodes x (num_gpus // num_nodes) columns and no more)."""
    num_nodes = check_count("num_nodes", num_nodes)
    if num_gpus % num_nodes:
        raise EplbError(f"num_nodes ({num_nodes}) must divide the {num_gpus} GPUs evenly")
    return num_nodes


def check_load(load_LE) -> np.ndarray:
    """load_LE as float64 [L, E >= 1], finite and >= 0."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    if load_LE.ndim != 2 or load_LE.shape[1] == 0:
        raise EplbError(f"load must be [layers, experts] with at least one expert, got shape {load_LE.shape}")
    if not np.isfinite(load_LE).all() or (load_LE < 0).any():
        raise EplbError("load must be finite and >= 0")
    return load_LE


def check_load_and_maps(load_LE, num_gpus: int, **maps) -> tuple[np.ndarray, int, int]:
    """load_LE checked as float64 [L, E] (finite, >= 0) together with the [L, P] maps it is
    planned on (see check_maps, with E from the load). Returns (load_LE, L, P)."""
    load_LE = check_load(load_LE)
    L, P = check_maps(num_gpus, load_LE.shape[1], **maps)
    if load_LE.shape[0] != L:
        raise EplbError(f"load must be [layers, experts] for the {L} layers of the maps, got shape {load_LE.shape}")
    return load_LE, L, P

