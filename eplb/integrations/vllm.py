"""vLLM plug-in: eplb's planner as vLLM's EPLB policy, and an initial map from a file.

Legend: L = MoE layers, E = logical experts, G = EP ranks (GPUs), N = nodes, P = slots.

vLLM (0.33) picks its EPLB policy from `EPLB_POLICIES[eplb_config.policy]`, and the policy
name is a closed literal ("default"), so a new name fails config validation. This module is
a `vllm.general_plugins` entry point (pyproject.toml: `eplb = "eplb.integrations.vllm:register"`),
which vLLM loads in every process (API server, engine core, workers). It does nothing unless
`EPLB_VLLM_POLICY` is set, so installing eplb never changes vLLM by itself:
- `EPLB_VLLM_POLICY="PLANNER[,key=value...]"`: install eplb's planner as
  `EPLB_POLICIES["default"]`. Keys are the planner's settings (`eplb plan --set`) and the
  move budget from the map vLLM serves now: `max_moves`, `max_moves_per_gpu`, `move_cost`.
  `static` is a planner of its own here: always the initial map (needs the next variable).
- `EPLB_VLLM_INITIAL_MAP=FILE`: an eplb placement JSON (`eplb plan --format eplb`) or a vLLM
  `.pt` export (`--format vllm`), served from vLLM's first rearrangement on (vLLM starts every
  model with the trivial map and rearranges first after `step_interval // 4` steps). The file
  must match the model: MoE layers and slots are checked, and a mismatch is refused with both
  numbers.
The policy is migration-aware: vLLM passes the map it serves (`old_global_expert_indices`,
[L, P]) and eplb relabels the new plan to keep the most replicas where they are (plus the
move budget above), so vLLM's weight mover copies fewer experts. vLLM splits an expert's
tokens evenly among its replicas (hash of the token index), so plans are made for the even
split (eplb.dispatch.EvenSplit).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from functools import lru_cache

import numpy as np

from eplb.core.placement import Placement
from eplb.errors import EplbError
from eplb.formats import load_placement
from eplb.formats.export import read_placement
from eplb.integrations import check_version, parse_spec, prime
from eplb.migration import Budget, keep_slots
from eplb.planning.front_door import plan
from planners.api import planner_names, planner_settings

ENV_POLICY = "EPLB_VLLM_POLICY"
ENV_INITIAL = "EPLB_VLLM_INITIAL_MAP"
ENV_ANY_VERSION = "EPLB_VLLM_ANY_VERSION"
SUPPORTED_VERSIONS = ("0.33.0",)
BUDGET_KEYS = ("max_moves", "max_moves_per_gpu", "move_cost")

logger = logging.getLogger("eplb.integrations.vllm")


class VllmPolicyError(EplbError, AssertionError):
    """Invalid policy parameters. Also an AssertionError: vLLM's own policy asserts on them,
    and vLLM's tests (and callers) expect that type."""


def register() -> None:
    """vLLM general-plugin entry point: install the eplb policy when EPLB_VLLM_POLICY is set."""
    spec = os.environ.get(ENV_POLICY)
    if not spec:
        return
    import vllm
    from vllm.distributed.eplb import policy as policies

    check_version("vLLM", vllm.__version__, SUPPORTED_VERSIONS, ENV_ANY_VERSION)
    cls = policy_class()
    configure(cls, spec, os.environ.get(ENV_INITIAL))
    if cls.planner != "static" and multiprocessing.parent_process() is None:
        # vLLM plans synchronously in every worker's rearrangement: start the kernels' compiles
        # now, once (from the top process: vLLM's own processes are its children), while the
        # model loads.
        prime(cls.planner, cls.settings)
    # eplb_state imported the same dict object (`from .policy import EPLB_POLICIES`): mutate it.
    policies.EPLB_POLICIES["default"] = cls
    logger.info("eplb: vLLM EPLB policy 'default' is eplb's %s", spec)


def configure(cls, spec: str, initial_map: str | None = None) -> None:
    """Set the planner, its settings and the initial map on the policy class."""
    planner, settings = parse_spec(spec, ENV_POLICY)
    budget = {k: settings.pop(k) for k in BUDGET_KEYS if k in settings}
    if planner == "static":
        if not initial_map:
            raise EplbError(f"{ENV_POLICY}=static serves the initial map: set {ENV_INITIAL}=FILE too")
        if settings or budget:
            raise EplbError(f"{ENV_POLICY}=static takes no settings, got {', '.join({**settings, **budget})}")
    elif planner not in planner_names():
        raise EplbError(f"{ENV_POLICY}: unknown planner {planner!r}: choose one of "
                        f"{', '.join(planner_names() + ['static'])}")
    else:
        known = planner_settings(planner)
        unknown = [k for k in settings if k not in known]
        if unknown:
            raise EplbError(f"{ENV_POLICY}: planner {planner!r} has no setting(s) {', '.join(unknown)}; its "
                            f"settings are {', '.join(known) or 'none'}, plus the budget {', '.join(BUDGET_KEYS)}")
    try:
        cls.budget = Budget(**budget)  # checked now, not at vLLM's first rearrangement
    except (EplbError, TypeError, ValueError) as exc:  # e.g. max_moves=abc, given as text
        raise EplbError(f"{ENV_POLICY}: the move budget {budget!r} is refused: {exc}") from None
    cls.planner, cls.settings = planner, settings
    cls.initial_map = initial_map or None
    cls.initial_served = False


@lru_cache(maxsize=1)
def policy_class():
    """The policy class (a subclass of vLLM's AbstractEplbPolicy), built once vLLM is importable."""
    from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy

    class EplbPolicy(AbstractEplbPolicy):
        """eplb's planner behind vLLM's policy interface (classmethods, as vLLM calls them)."""

        planner = "greedy"
        settings: dict = {}
        budget = Budget()
        initial_map: str | None = None
        initial_served = False

        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            """phy2log [L, P] int64 (CPU) for loads `weight` [L, E]; the arguments as in vLLM."""
            import torch

            load_LE, old_LP = _check_args(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                          old_global_expert_indices)
            if cls.initial_map and (cls.planner == "static" or not cls.initial_served):
                initial_LP = _initial_map(cls.initial_map, load_LE.shape, num_replicas, num_ranks)
                # Served once vLLM has committed it (the next call finds it in place); the profile
                # run's rearrangement is never committed, so it does not count.
                cls.initial_served = old_LP is not None and np.array_equal(old_LP, initial_LP)
                if not cls.initial_served:
                    return torch.from_numpy(initial_LP)
                if cls.planner == "static":
                    return torch.from_numpy(initial_LP)
            return torch.from_numpy(_plan(cls, load_LE, num_replicas, num_groups, num_nodes, num_ranks, old_LP))

        @classmethod
        def preserve_intragpu_slots(cls, phy2log, num_ranks, old_phy2log):
            """Experts a GPU keeps go back to the slot they held (vLLM's DefaultEplbPolicy has
            the same step): eplb.migration.keep_slots. numpy in, numpy out."""
            new_LP, old_LP = np.asarray(phy2log), np.asarray(old_phy2log)
            if num_ranks <= 0 or new_LP.shape != old_LP.shape or new_LP.shape[1] % num_ranks:
                return new_LP
            return np.take_along_axis(new_LP, keep_slots(old_LP, new_LP, int(num_ranks)), axis=1)

    return EplbPolicy


def _check_args(weight, num_replicas, num_groups, num_nodes, num_ranks, old):
    """(load_LE float64, old_LP int64 or None), or VllmPolicyError naming the bad value."""
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise VllmPolicyError(f"{name} must be a positive integer, got {v!r}")
    if hasattr(weight, "detach"):
        weight = weight.detach().float().cpu().numpy()
    load_LE = np.asarray(weight, dtype=np.float64)
    if load_LE.ndim != 2:
        raise VllmPolicyError(f"weight must be [layers, logical experts], got shape {load_LE.shape}")
    if not np.all(np.isfinite(load_LE)) or (load_LE.size and load_LE.min() < 0):
        raise VllmPolicyError("weight must hold finite, non-negative expert loads")
    E = load_LE.shape[1]
    if num_replicas % num_ranks:
        raise VllmPolicyError(f"num_replicas ({num_replicas}) must be a multiple of num_ranks ({num_ranks})")
    if num_ranks % num_nodes:
        raise VllmPolicyError(f"num_ranks ({num_ranks}) must be a multiple of num_nodes ({num_nodes})")
    if num_replicas < E:
        raise VllmPolicyError(f"num_replicas ({num_replicas}) cannot hold the {E} logical experts")
    if old is None:
        return load_LE, None
    if hasattr(old, "detach"):
        old = old.detach().cpu().numpy()
    old_LP = np.asarray(old, dtype=np.int64)
    # vLLM pads the map with -1 for slots of elastic-EP ranks; such a map is no "previous".
    if old_LP.shape != (load_LE.shape[0], num_replicas) or old_LP.min() < 0 or old_LP.max() >= E:
        return load_LE, None
    return load_LE, old_LP


def _plan(cls, load_LE, num_replicas, num_groups, num_nodes, num_ranks, old_LP) -> np.ndarray:
    L, E = load_LE.shape
    # vLLM's own policy falls back to its global strategy when groups do not divide over nodes.
    groups = num_groups if num_groups > 1 and E % num_groups == 0 and num_groups % num_nodes == 0 else None
    previous = None
    if old_LP is not None and np.bincount(old_LP.ravel() + E * np.repeat(np.arange(L), num_replicas),
                                          minlength=L * E).min() > 0:
        previous = Placement(old_LP, num_ranks, E, num_nodes)
    result = plan(load_LE, num_gpus=num_ranks, num_nodes=num_nodes, slots_per_gpu=num_replicas // num_ranks,
                  planner=cls.planner, settings=dict(cls.settings), num_expert_groups=groups,
                  previous=previous, budget=cls.budget if previous is not None else None, dispatch="even")
    return np.array(result.placement.phy2log_LP, dtype=np.int64)  # writable: torch.from_numpy shares it


@lru_cache(maxsize=4)
def _read_initial(path: str) -> Placement:
    if path.endswith(".pt"):
        return read_placement(path, "vllm")
    return load_placement(path)


def _initial_map(path: str, load_shape: tuple, num_replicas: int, num_ranks: int) -> np.ndarray:
    """The initial map's phy2log [L, P], checked against vLLM's model and EP group."""
    p = _read_initial(path)
    L, E = load_shape
    if p.num_layers != L:
        raise EplbError(f"{ENV_INITIAL}={path}: the map has {p.num_layers} MoE layers, the model has {L}: "
                        f"plan on a trace of this model")
    if p.num_logical_experts != E:
        raise EplbError(f"{ENV_INITIAL}={path}: the map is for {p.num_logical_experts} logical experts, the model "
                        f"has {E}")
    if p.num_slots != num_replicas:
        raise EplbError(f"{ENV_INITIAL}={path}: the map has {p.num_slots} slots, vLLM has {num_replicas} "
                        f"physical experts ({E} + {num_replicas - E} redundant): plan with --redundant "
                        f"{num_replicas - E}, or set num_redundant_experts to {p.num_slots - E}")
    if p.num_gpus != num_ranks:
        raise EplbError(f"{ENV_INITIAL}={path}: the map is for {p.num_gpus} GPUs, vLLM's EP group has {num_ranks} "
                        f"ranks: plan with --gpus {num_ranks}")
    return np.array(p.phy2log_LP, dtype=np.int64)
