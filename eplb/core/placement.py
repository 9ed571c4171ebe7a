"""Placement: which logical expert each physical slot holds, per MoE layer.

Legend: L = MoE layers, E = logical experts, P = physical slots, G = GPUs (ranks),
X = most replicas any expert has. Slot p lives on GPU p // (P // G).

Glossary (the words every engine uses):
- logical expert: one of the model's E routed experts, as the router sees it.
- physical slot: a place for one expert's weights on one GPU; P = G x slots per GPU.
- replica: a copy of a logical expert in a physical slot; every expert has >= 1.
- redundant slots: P - E, the slots that hold extra replicas of hot experts.
Worked example: 256 logical + 32 redundant = 288 physical slots; 32 GPUs -> 9 slots per GPU.

`-1` in `log2phy_LEX` means "no replica" (padding).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from eplb.core.files import MAX_INPUT_ENV, max_input_bytes
from eplb.core.topology import Topology
from eplb.errors import EplbError, is_whole, number_array, readonly, whole_array, whole_number

FORMAT_NAME = "eplb.placement"
"""The "format" a placement file names. It is the file's, not the module's: a package move
must not change it (eplb 2026-12-06..07 wrote "eplb.core.placement" by mistake; it is read too)."""
FORMAT_NAMES_READ = (FORMAT_NAME, "eplb.core.placement")
FORMAT_VERSION = 1


@dataclass(frozen=True, eq=False)
class Placement:
    """An expert-to-slot map for every MoE layer, with optional per-replica token shares."""

    phy2log_LP: np.ndarray
    """Logical expert held by each physical slot, int64 [L, P]."""
    num_gpus: int
    """G: GPUs (ranks); slot p lives on GPU p // (P // G)."""
    num_logical_experts: int
    """E: routed experts of the model."""
    num_nodes: int = 1
    """N: nodes; GPU g lives on node g // (G // N)."""
    layer_ids: np.ndarray | None = None
    """Hidden-layer index of each MoE layer, int64 [L]; default 0..L-1."""
    dispatch_weights_LP: np.ndarray | None = None
    """Share of its expert's tokens each replica takes, float64 [L, P]; the shares of one
    expert in one layer sum to 1. None means an even split among replicas."""
    planner: str = ""
    """Name of the planner that made it (informational)."""
    metrics: dict = field(default_factory=dict)
    """Free-form metrics recorded by the planner (informational, JSON-serialisable)."""
    partial: bool = False
    """True when an expert may have no replica: what the surviving GPUs of a placement still
    hold after a failure (`on_gpus`), a placement to migrate from, never one to serve."""

    def __post_init__(self) -> None:
        phy = number_array("physical_to_logical map", self.phy2log_LP)
        if phy.ndim != 2:
            raise EplbError(f"physical_to_logical map must be 2-D [layers, slots], got shape {phy.shape}")
        if not np.issubdtype(phy.dtype, np.integer):
            raise EplbError(f"physical_to_logical map must hold integers, got dtype {phy.dtype}")
        L, P = phy.shape
        G, E, N = (whole_number(name, getattr(self, name), 1)
                   for name in ("num_gpus", "num_logical_experts", "num_nodes"))
        if P < 1:
            raise EplbError(f"physical_to_logical map has no slots (shape {phy.shape}): a placement needs "
                            f"at least one slot per GPU")
        if P % G:
            raise EplbError(f"{P} physical slots do not split evenly over {G} GPUs")
        if G % N:
            raise EplbError(f"num_gpus ({G}) must be divisible by num_nodes ({N})")
        phy64 = readonly(phy.astype(np.int64))
        if L and not (phy.min() >= 0 and phy.max() < E):
            bad = phy[(phy < 0) | (phy >= E)][0]
            raise EplbError(f"physical_to_logical holds expert id {bad}, outside 0..{E - 1}")
        if not isinstance(self.partial, (bool, np.bool_)):
            raise EplbError(f"partial must be true or false, got {self.partial!r}")
        # Before the [L, E] count below: E comes from a file too (10**12 would allocate terabytes).
        if E > P and not self.partial:
            raise EplbError(f"num_logical_experts ({E}) exceeds the {P} physical slots: every expert needs a slot")
        if 8 * L * E > max_input_bytes():
            raise EplbError(f"num_logical_experts ({E}) x {L} layers is more than the input limit allows "
                            f"({MAX_INPUT_ENV})")
        count_LE = np.bincount((np.arange(L)[:, None] * E + phy64).ravel(), minlength=L * E).reshape(L, E)
        if L and count_LE.min() == 0 and not self.partial:
            layer, expert = np.argwhere(count_LE == 0)[0]
            raise EplbError(f"logical expert {expert} has no replica in layer index {layer}")
        object.__setattr__(self, "phy2log_LP", phy64)
        object.__setattr__(self, "num_gpus", G)
        object.__setattr__(self, "num_logical_experts", E)
        object.__setattr__(self, "num_nodes", N)
        object.__setattr__(self, "partial", bool(self.partial))
        object.__setattr__(self, "_count_LE", readonly(count_LE))
        ids = np.arange(L) if self.layer_ids is None else number_array("layer_ids", self.layer_ids)
        if ids.shape != (L,) or not np.issubdtype(ids.dtype, np.integer):
            raise EplbError(f"layer_ids must be {L} integers, got shape {ids.shape} dtype {ids.dtype}")
        if self.layer_ids is not None and L and (ids.min() < 0 or len(np.unique(ids)) != L):
            raise EplbError(f"layer_ids must be distinct non-negative integers, got {ids.tolist()}")
        object.__setattr__(self, "layer_ids", readonly(ids.astype(np.int64)))
        if self.dispatch_weights_LP is not None:
            w = np.asarray(self.dispatch_weights_LP, dtype=np.float64)
            if w.shape != (L, P):
                raise EplbError(f"dispatch_weights must have shape {(L, P)}, got {w.shape}")
            if not np.all(np.isfinite(w)) or w.min() < 0:
                raise EplbError("dispatch_weights must be finite and non-negative")
            sums_LE = np.bincount((np.arange(L)[:, None] * E + phy).ravel(), weights=w.ravel(),
                                  minlength=L * E).reshape(L, E)
            sums_LE[count_LE == 0] = 1.0  # an expert a partial placement lost has no shares to sum
            if not np.allclose(sums_LE, 1.0, atol=1e-6):
                layer, expert = np.argwhere(~np.isclose(sums_LE, 1.0, atol=1e-6))[0]
                raise EplbError(
                    f"dispatch_weights of expert {expert} in layer index {layer} sum to "
                    f"{sums_LE[layer, expert]:.6f}, not 1"
                )
            object.__setattr__(self, "dispatch_weights_LP", readonly(w))

    # Derived shapes -------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.phy2log_LP.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log_LP.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def topology(self) -> Topology:
        return Topology(num_gpus=self.num_gpus, slots_per_gpu=self.slots_per_gpu, num_nodes=self.num_nodes)

    @property
    def replica_count_LE(self) -> np.ndarray:
        """Replicas of each logical expert, int64 [L, E]."""
        return self._count_LE  # type: ignore[attr-defined]

    @property
    def log2phy_LEX(self) -> np.ndarray:
        """Physical slots of each logical expert, int64 [L, E, X], padded with -1."""
        L, P = self.phy2log_LP.shape
        E = self.num_logical_experts
        X = int(self.replica_count_LE.max()) if L else 1
        out = np.full((L, E, X), -1, dtype=np.int64)
        order_LP = np.argsort(self.phy2log_LP, axis=1, kind="stable")
        sorted_LP = np.take_along_axis(self.phy2log_LP, order_LP, axis=1)
        # rank of each slot among the replicas of its expert (0, 1, ...), in slot order
        first_LE = np.cumsum(self.replica_count_LE, axis=1) - self.replica_count_LE
        rank_LP = np.arange(P)[None, :] - np.take_along_axis(first_LE, sorted_LP, axis=1)
        out[np.arange(L)[:, None], sorted_LP, rank_LP] = order_LP
        return out

    def gpu_of_slot(self) -> np.ndarray:
        """gpu_P: the GPU each physical slot lives on."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    def replica_weights(self) -> np.ndarray:
        """Share of its expert's tokens each slot takes, float64 [L, P] (even split if unset)."""
        if self.dispatch_weights_LP is not None:
            return self.dispatch_weights_LP
        cnt_LP = np.take_along_axis(self.replica_count_LE, self.phy2log_LP, axis=1)
        return 1.0 / cnt_LP

    def _load_and_weights(self, load_LE, weights_LP) -> tuple[np.ndarray, np.ndarray]:
        """load_LE as float64 [L, E] and the shares [L, P] (the plan's when None), shapes checked."""
        load_LE = number_array("loads", load_LE).astype(np.float64)  # text, None, bool: named, not a TypeError
        if load_LE.shape != (self.num_layers, self.num_logical_experts):
            raise EplbError(
                f"loads have shape {load_LE.shape}, but the placement needs "
                f"{(self.num_layers, self.num_logical_experts)} [layers, logical experts]"
            )
        w_LP = (self.replica_weights() if weights_LP is None else
                number_array("dispatch weights", weights_LP).astype(np.float64))
        if w_LP.shape != self.phy2log_LP.shape:  # a [P] row would broadcast over layers silently
            raise EplbError(f"dispatch weights have shape {w_LP.shape}, but the placement needs "
                            f"{self.phy2log_LP.shape} [layers, slots]")
        return load_LE, w_LP

    def slot_loads(self, load_LE: np.ndarray, weights_LP: np.ndarray | None = None) -> np.ndarray:
        """Tokens each physical slot serves, float64 [L, P], for logical loads [L, E]."""
        load_LE, w_LP = self._load_and_weights(load_LE, weights_LP)
        return np.take_along_axis(load_LE, self.phy2log_LP, axis=1) * w_LP

    def gpu_loads(self, load_LE: np.ndarray, weights_LP: np.ndarray | None = None) -> np.ndarray:
        """Tokens each GPU serves, float64 [L, G], under `weights_LP` (the plan's shares if None)."""
        load_LE, w_LP = self._load_and_weights(load_LE, weights_LP)
        return gpu_loads(self.phy2log_LP, load_LE, self.num_gpus, w_LP)

    def with_metrics(self, metrics: dict) -> Placement:
        """This placement with other `metrics`: the map, shares and counts are shared, not checked
        again (they are unchanged, and a frozen Placement's arrays cannot be written)."""
        out = copy.copy(self)
        object.__setattr__(out, "metrics", dict(metrics))
        return out

    def with_weights(self, dispatch_weights_LP: np.ndarray | None) -> Placement:
        return replace(self, dispatch_weights_LP=dispatch_weights_LP, metrics=dict(self.metrics))

    def on_gpus(self, gpus) -> Placement:
        """The slots GPUs `gpus` (indices, in this order) hold, as a placement of their own on
        len(gpus) GPUs and one node (survivors of a failure need not split evenly over the old
        nodes); `partial` when some expert has no replica left on them. Weights are dropped:
        an expert's shares no longer sum to 1 once some of its replicas are gone."""
        idx = np.asarray(gpus, dtype=np.int64).reshape(-1)
        G, S = self.num_gpus, self.slots_per_gpu
        if idx.size == 0 or idx.min() < 0 or idx.max() >= G or np.unique(idx).size != idx.size:
            raise EplbError(f"gpus must be distinct GPU indices in 0..{G - 1}, got {idx.tolist()}")
        phy_LP = self.phy2log_LP.reshape(self.num_layers, G, S)[:, idx].reshape(self.num_layers, idx.size * S)
        present = np.bincount((np.arange(self.num_layers)[:, None] * self.num_logical_experts + phy_LP).ravel(),
                              minlength=self.num_layers * self.num_logical_experts)
        return Placement(phy_LP, idx.size, self.num_logical_experts, 1, self.layer_ids, None, self.planner,
                         partial=bool((present == 0).any()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        same_w = (self.dispatch_weights_LP is None) == (other.dispatch_weights_LP is None) and (
            self.dispatch_weights_LP is None
            or np.allclose(self.dispatch_weights_LP, other.dispatch_weights_LP)
        )
        return (
            self.num_gpus == other.num_gpus
            and self.num_nodes == other.num_nodes
            and self.num_logical_experts == other.num_logical_experts
            and np.array_equal(self.phy2log_LP, other.phy2log_LP)
            and np.array_equal(self.layer_ids, other.layer_ids)
            and self.partial == other.partial
            and same_w
        )

    __hash__ = None  # type: ignore[assignment]

    # Dict conversion (eplb.formats writes it as JSON) ------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "physical_to_logical_map": self.phy2log_LP.tolist(),
            "layer_ids": self.layer_ids.tolist(),
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "num_logical_experts": self.num_logical_experts,
            "planner": self.planner,
            "metrics": self.metrics,
        }
        if self.dispatch_weights_LP is not None:
            d["dispatch_weights"] = self.dispatch_weights_LP.tolist()
        if self.partial:
            d["partial"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "placement") -> Placement:
        if not isinstance(d, dict):
            raise EplbError(f"{source}: expected a JSON object, got {type(d).__name__}")
        # A file of another kind or a newer layout is refused, not read by guesswork.
        fmt, version = d.get("format", FORMAT_NAME), d.get("version", FORMAT_VERSION)
        if not isinstance(fmt, str) or fmt not in FORMAT_NAMES_READ:
            raise EplbError(f"{source}: format is {fmt!r}, not {FORMAT_NAME!r}: not an eplb placement file")
        if not is_whole(version) or not 1 <= version <= FORMAT_VERSION:
            raise EplbError(f"{source}: placement format version {version!r} is not one this eplb reads "
                            f"(1..{FORMAT_VERSION}): write it again with this version, or upgrade eplb")
        missing = [k for k in ("physical_to_logical_map", "num_gpus", "num_logical_experts") if k not in d]
        if missing:
            raise EplbError(f"{source}: missing key(s) {', '.join(missing)} (not an eplb placement file?)")
        # whole_array, not asarray(dtype=int64): that reads expert 2.7 or layer 3.5 as 2 or 3.
        phy = whole_array(f"{source}: physical_to_logical_map", d["physical_to_logical_map"])
        sizes = {key: whole_number(f"{source}: {key}", d.get(key, 1), None)  # int(4.7) would read 4 GPUs
                 for key in ("num_gpus", "num_logical_experts", "num_nodes")}
        layer_ids = d.get("layer_ids")
        if layer_ids is not None:
            layer_ids = whole_array(f"{source}: layer_ids", layer_ids)
        weights = d.get("dispatch_weights")
        if weights is not None:
            weights = number_array(f"{source}: dispatch_weights", weights).astype(np.float64)
        metrics = d.get("metrics")
        if metrics is not None and not isinstance(metrics, dict):
            raise EplbError(f"{source}: metrics must be a JSON object {{name: value}}, got {type(metrics).__name__}")
        planner = d.get("planner", "")
        if not isinstance(planner, str):
            raise EplbError(f"{source}: planner must be a name (a string), got {planner!r}")
        try:
            return cls(
                phy2log_LP=phy,
                num_gpus=sizes["num_gpus"],
                num_logical_experts=sizes["num_logical_experts"],
                num_nodes=sizes["num_nodes"],
                layer_ids=layer_ids,
                dispatch_weights_LP=weights,
                planner=planner,
                metrics=dict(metrics or {}),
                partial=d.get("partial", False),
            )
        except EplbError as exc:
            raise EplbError(f"{source}: {exc}") from None


def check_same_layers(placement: Placement, layer_ids, *, placement_name: str = "the placement",
                      trace_name: str = "the trace") -> None:
    """Refuse a placement made for other MoE layers than `layer_ids` [L] (a trace's): the same
    shape is not enough, rows of another model's layers would be scored or migrated silently."""
    ids = np.asarray(layer_ids)
    if placement.layer_ids.shape == ids.shape and np.array_equal(placement.layer_ids, ids):
        return
    raise EplbError(f"{placement_name} is for MoE layer ids {_ids_text(placement.layer_ids)} but {trace_name} holds "
                    f"layer ids {_ids_text(ids)}: use a placement and a trace of the same model")


def _ids_text(ids) -> str:
    a = [int(x) for x in np.asarray(ids).reshape(-1)]
    if not a:
        return "(none)"
    if len(a) > 2 and a == list(range(a[0], a[-1] + 1)):
        return f"{a[0]}..{a[-1]}"
    return ", ".join(map(str, a[:4])) + (", ..." if len(a) > 4 else "")


def gpu_loads(phy2log_LP: np.ndarray, load_LE, num_gpus: int, weights_LP=None) -> np.ndarray:
    """Tokens each GPU serves, float64 [..., L, G]: the one definition every score builds on.

    Slot p (on GPU p // (P / G)) serves load_LE[..., l, phy2log_LP[l, p]] x weights_LP[l, p].
    load_LE may carry leading axes (windows: [T, L, E] gives [T, L, G]). weights_LP: shares
    [L, P], or one number for every slot (1.0 when load_LE already holds the load of one
    replica); None: an even split among the replicas phy2log_LP holds. Slots holding -1 (empty)
    serve nothing. Trusts its input: callers check shapes and ids at their boundary.
    """
    phy_LP = np.asarray(phy2log_LP)
    load = np.asarray(load_LE, dtype=np.float64)
    L, P = phy_LP.shape
    E = load.shape[-1]
    valid_LP = phy_LP >= 0
    full = bool(valid_LP.all())
    e_LP = phy_LP if full else np.where(valid_LP, phy_LP, 0)
    if weights_LP is None:
        count_LE = np.bincount((np.arange(L)[:, None] * E + e_LP)[valid_LP], minlength=L * E).reshape(L, E)
        weights_LP = 1.0 / np.maximum(np.take_along_axis(count_LE, e_LP, axis=1), 1)
    slot = load[..., np.arange(L)[:, None], e_LP] * weights_LP
    if not full:
        slot = np.where(valid_LP, slot, 0.0)
    return slot.reshape(*slot.shape[:-1], num_gpus, P // num_gpus).sum(axis=-1)


def contiguous_map(num_logical_experts: int, topology: Topology, num_layers: int) -> np.ndarray:
    """phy2log_LP of the contiguous placement (the no-EPLB baseline), the same for every layer.

    Expert e sits on GPU e // (E / G): experts are split over GPUs in id order, as evenly as
    possible. A GPU's spare slots repeat its own experts, which splits their tokens inside the
    GPU and so leaves every GPU's load exactly as without redundancy: what a server does with
    no load balancing. With fewer experts than GPUs (E < G), slot p holds expert p % E, the
    map SGLang starts from (every expert replicated round-robin, none balanced).
    """
    G, S = topology.num_gpus, topology.slots_per_gpu
    if num_logical_experts > G * S:
        raise EplbError(f"{G} GPUs x {S} slots cannot hold {num_logical_experts} experts")
    if num_logical_experts < G:
        # No split in id order gives every GPU an expert: the engines' own default then, slot p
        # holds expert p % E (SGLang's trivial map), distinct on a GPU while S <= E.
        if S > num_logical_experts:
            raise EplbError(f"{S} slots per GPU exceed the {num_logical_experts} experts")
        return np.tile(np.arange(G * S, dtype=np.int64) % num_logical_experts, (num_layers, 1))
    row = np.empty(G * S, dtype=np.int64)
    for g, experts in enumerate(np.array_split(np.arange(num_logical_experts), G)):
        row[g * S:(g + 1) * S] = np.resize(experts, S)  # spare slots cycle the GPU's own experts
    return np.tile(row, (num_layers, 1))


def contiguous_placement(num_logical_experts: int, topology: Topology, layer_ids) -> Placement:
    """The contiguous (no-EPLB) Placement on `topology` for the MoE layers `layer_ids` [L]."""
    ids = np.asarray(layer_ids)
    return Placement(contiguous_map(num_logical_experts, topology, len(ids)), topology.num_gpus,
                     num_logical_experts, topology.num_nodes, ids, planner="contiguous")
