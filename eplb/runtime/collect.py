"""Collect router traces from a torch model with forward hooks on its router (gate) modules.

Legend: T = windows, L = MoE layers (routers), E = logical experts, K = top-k, N = tokens.

    from eplb.runtime.collect import RouterCollector
    with RouterCollector(model, window_tokens=4096) as rec:     # hooks attached
        for batch in batches:
            model(batch)
    rec.save("trace.npz")                                        # hooks are gone by now

Routers are found by class (`router_class`, default `eplb.runtime.model.Router`), or by a
regular expression on module names (`name_pattern`, searched in `model.named_modules()`).
Each hook takes the chosen expert ids out of the router's output with `ids_from`: None
(the output itself if it is a tensor, else its element 0, as DeepSeek's gate returns
`(topk_ids, topk_weights)`), an int (index into a tuple output), a str (attribute or key) or a
callable `output -> ids` (e.g. `lambda logits: logits.topk(2).indices` for a router that
returns logits). Ids are [tokens, K] (any leading shape is flattened to tokens).

Counting: per layer, per window, `bincount` of the ids (CPU; on accelerators `scatter_add_`
does the same without bincount's device-to-host sync). Windows close every
`window_tokens` tokens exactly (a batch that straddles a boundary is split by token
position, the same way in every layer, since every layer sees the same tokens) and on
`next_window()`. Optionally the first `keep_tokens` tokens' ids are kept (bounded buffer)
and written as the trace's per-token rows.

Data / expert parallelism: give `process_group`; `trace()` sums counts over its ranks with
`all_reduce` (every rank must call it). Pass a group whose ranks see *different* tokens
(attention data parallel); ranks that replicate the same tokens (tensor parallel) would be
counted twice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eplb.core.trace import REQUIRED_META, Trace
from eplb.errors import EplbError, positive_integer, whole_number
from eplb.formats.native import save_trace
from eplb.runtime.model import Router

IdsFrom = None | int | str | Callable[[Any], torch.Tensor]


def _extract(output: Any, ids_from: IdsFrom) -> torch.Tensor:
    """The expert-id tensor in a router's output."""
    if callable(ids_from):
        ids = ids_from(output)
    elif ids_from is None:
        ids = output if isinstance(output, torch.Tensor) else output[0]
    elif isinstance(ids_from, int):
        ids = output[ids_from]
    else:
        ids = output[ids_from] if isinstance(output, dict) else getattr(output, ids_from)
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise EplbError(
            f"router output gave {type(ids).__name__}"
            + (f" of dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else "")
            + " where integer expert ids were expected: set ids_from to pick them out of the output "
              "(an index, an attribute name, or a callable such as lambda out: out.topk(k).indices)"
        )
    return ids


def count_experts(flat_ids: torch.Tensor, num_logical_experts: int) -> torch.Tensor:
    """Tokens per expert, int64 [E], for a flat id tensor."""
    if flat_ids.device.type == "cpu":
        if flat_ids.numel() and int(flat_ids.min()) < 0:
            raise EplbError(f"router chose expert id {int(flat_ids.min())}: ids must be 0..{num_logical_experts - 1} "
                            "(drop padding / dropped-token markers in ids_from)")
        c = torch.bincount(flat_ids, minlength=num_logical_experts)
        if c.shape[0] != num_logical_experts:
            raise EplbError(f"router chose expert id {c.shape[0] - 1}, but the model has {num_logical_experts} experts "
                            f"(0..{num_logical_experts - 1})")
        return c
    # bincount on accelerators reads the max back to the host to size its output (a sync per
    # layer); scatter_add_ into a fixed-size tensor stays asynchronous.
    return scatter_count(flat_ids, num_logical_experts)


def scatter_count(flat_ids: torch.Tensor, num_logical_experts: int) -> torch.Tensor:
    """Tokens per expert, int64 [E], without a host sync (ids must be in 0..E-1: not checked)."""
    c = torch.zeros(num_logical_experts, dtype=torch.int64, device=flat_ids.device)
    return c.scatter_add_(0, flat_ids.long(), torch.ones_like(flat_ids, dtype=torch.int64))


def _config_value(cfg: Any, *names: str) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def meta_from_model(model: nn.Module) -> dict:
    """Trace meta from `model.config` (eplb ModelConfig or a HF-style config); unknown -> None."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "trace_meta"):
        return dict(cfg.trace_meta())
    meta = {k: None for k in REQUIRED_META}
    meta["synthetic"] = False
    if cfg is not None:
        meta["model"] = _config_value(cfg, "name_or_path", "_name_or_path", "model_type")
        meta["num_hidden_layers"] = _config_value(cfg, "num_hidden_layers", "num_layers", "n_layer")
        meta["num_experts"] = _config_value(cfg, "n_routed_experts", "num_experts", "num_local_experts")
        meta["top_k"] = _config_value(cfg, "num_experts_per_tok", "top_k", "moe_top_k")
        meta["num_expert_groups"] = _config_value(cfg, "n_group", "num_groups", "num_expert_groups")
        meta["topk_groups"] = _config_value(cfg, "topk_group", "topk_groups")
    return meta


class RouterCollector:
    """Context manager: per-window, per-layer expert counts from router forward hooks."""

    def __init__(
        self,
        model: nn.Module,
        *,
        router_class: type | tuple[type, ...] | None = None,
        name_pattern: str | None = None,
        ids_from: IdsFrom = None,
        num_logical_experts: int | None = None,
        layer_ids: list[int] | None = None,
        window_tokens: int | None = None,
        keep_tokens: int = 0,
        process_group: Any = None,
        meta: dict | None = None,
    ) -> None:
        """
        router_class / name_pattern: how to find the routers (default: eplb's Router class).
        ids_from: where the expert ids are in a router's output (see module docstring).
        num_logical_experts: E; default from model.config, then the router's `num_experts`.
        layer_ids: hidden-layer index of each router in model order; default from
            `model.moe_layers()` if present, else the first integer in the module name.
        window_tokens: close a window every this many tokens (None: only on next_window()).
        keep_tokens: keep the expert ids of this many first tokens (0: counts only).
        process_group: sum counts over this torch.distributed group in trace().
        meta: overrides for the trace meta (source, synthetic, ...).
        """
        window_tokens = None if window_tokens is None else positive_integer("window_tokens", window_tokens)
        keep_tokens = whole_number("keep_tokens", keep_tokens, 0)
        if ids_from is not None and not (callable(ids_from) or isinstance(ids_from, (int, str))):
            raise EplbError(f"ids_from must be None, an int, a str or a callable, got {type(ids_from).__name__}")
        self.model = model
        self.ids_from = ids_from
        self.window_tokens = None if window_tokens is None else int(window_tokens)
        self.keep_tokens = int(keep_tokens)
        self.process_group = process_group
        self.routers, self.layer_ids = self._find(model, router_class, name_pattern, layer_ids)
        self.meta = meta_from_model(model)
        self.meta.update(meta or {})
        E = num_logical_experts if num_logical_experts is not None else self.meta.get("num_experts")
        if E is None:
            E = getattr(self.routers[0][1], "num_experts", None)
        if E is None:
            raise EplbError("cannot tell the number of experts from the model: pass num_logical_experts")
        self.num_logical_experts = int(E)
        self.meta["num_experts"] = self.num_logical_experts
        L = len(self.routers)
        self._windows: list[torch.Tensor] = []                  # each [L, E] int64, on the ids' device
        self._pos_L = [0] * L                                   # tokens counted per layer so far
        self._win_L = [0] * L                                   # current window of each layer
        self._win_start = [0]                                   # first token (per layer) of each window
        self._kept_L: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self._kept_n_L = [0] * L
        self._top_k: int | None = None
        self._handles: list[Any] = []

    # Finding routers -------------------------------------------------------------------------

    @staticmethod
    def _find(model, router_class, name_pattern, layer_ids):
        if router_class is not None and name_pattern is not None:
            raise EplbError("give router_class or name_pattern, not both")
        if name_pattern is not None:
            try:
                rx = re.compile(name_pattern)
            except re.error as exc:
                raise EplbError(f"name_pattern {name_pattern!r} is not a valid regular expression: {exc}") from None
            found = [(n, m) for n, m in model.named_modules() if n and rx.search(n)]
            what = f"no module name matches {name_pattern!r}"
        else:
            if router_class is None:
                router_class = Router
            found = [(n, m) for n, m in model.named_modules() if isinstance(m, router_class)]
            what = f"no module of class {getattr(router_class, '__name__', router_class)} in the model"
        if not found:
            raise EplbError(f"{what}: set router_class or name_pattern to the model's gate modules")
        if layer_ids is None:
            if hasattr(model, "moe_layers"):
                by_module = {id(moe.gate): lid for lid, moe in model.moe_layers() if hasattr(moe, "gate")}
                if all(id(m) in by_module for _, m in found):
                    layer_ids = [by_module[id(m)] for _, m in found]
            if layer_ids is None:
                nums = [[int(s) for s in n.split(".") if s.isdigit()] for n, _ in found]
                layer_ids = [v[0] for v in nums] if all(nums) else list(range(len(found)))
        layer_ids = [int(i) for i in layer_ids]
        if len(layer_ids) != len(found):
            raise EplbError(f"layer_ids has {len(layer_ids)} entries but {len(found)} routers were found")
        if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])) or min(layer_ids) < 0:
            raise EplbError(
                f"layer ids of the routers must be non-negative and strictly increasing in model order, "
                f"got {layer_ids} for {[n for n, _ in found][:4]}...: pass layer_ids"
            )
        return found, layer_ids

    # Hooks -----------------------------------------------------------------------------------

    def __enter__(self) -> RouterCollector:
        if self._handles:
            raise EplbError("this collector is already attached")
        for l, (_, mod) in enumerate(self.routers):
            self._handles.append(mod.register_forward_hook(self._make_hook(l)))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks (counts are kept)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, l: int):
        def hook(module, inputs, output):
            self._observe(l, _extract(output, self.ids_from))
        return hook

    def _window_tensor(self, w: int, device: torch.device) -> torch.Tensor:
        while len(self._windows) <= w:
            # A normal tensor even when the hook runs under torch.inference_mode(): an inference
            # tensor could not be added to by a later forward outside inference mode.
            with torch.inference_mode(False):
                self._windows.append(torch.zeros(len(self.routers), self.num_logical_experts, dtype=torch.int64,
                                                 device=device))
        return self._windows[w]

    def _observe(self, l: int, ids: torch.Tensor) -> None:
        ids = ids.detach()
        ids_TK = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids.reshape(-1, 1)
        T, K = ids_TK.shape
        if self._top_k is None:
            self._top_k = K
        elif K != self._top_k:
            raise EplbError(f"router {self.routers[l][0]} chose {K} experts per token, earlier routers {self._top_k}")
        done = 0
        while done < T:
            w = self._win_L[l]
            n = T - done
            if self.window_tokens is not None:
                n = min(n, self._win_start[w] + self.window_tokens - self._pos_L[l]) if w < len(self._win_start) else n
            counts = self._window_tensor(w, ids_TK.device)
            counts[l] += count_experts(ids_TK[done:done + n].reshape(-1), self.num_logical_experts)
            self._pos_L[l] += n
            done += n
            if self.window_tokens is not None and self._pos_L[l] - self._win_start[w] >= self.window_tokens:
                self._advance(l, w)
        if self._kept_n_L[l] < self.keep_tokens:
            take = min(T, self.keep_tokens - self._kept_n_L[l])
            self._kept_L[l].append(ids_TK[:take].to(torch.int16))
            self._kept_n_L[l] += take

    def _advance(self, l: int, w: int) -> None:
        """Layer l moves from window w to w + 1 (the first layer to get there fixes its start)."""
        if len(self._win_start) == w + 1:
            self._win_start.append(self._pos_L[l])
        self._win_L[l] = w + 1

    def next_window(self) -> None:
        """Close the current window now (call between forwards). No-op if it is empty."""
        w = max(self._win_L)
        if all(p == self._win_start[w] for p in self._pos_L):
            return
        if len(set(self._pos_L)) != 1:
            raise EplbError(
                f"layers have seen different token counts {sorted(set(self._pos_L))}: "
                "call next_window() between forward passes, not inside one"
            )
        self._win_start = self._win_start[: w + 1] + [self._pos_L[0]]
        self._win_L = [w + 1] * len(self._win_L)

    # Results ---------------------------------------------------------------------------------

    @property
    def tokens_seen(self) -> int:
        """Tokens routed through the first router so far (this rank)."""
        return self._pos_L[0]

    def counts(self) -> np.ndarray:
        """Counts on this rank, int64 [T, L, E] (empty windows at the end dropped)."""
        L, E = len(self.routers), self.num_logical_experts
        if not self._windows:
            return np.zeros((0, L, E), dtype=np.int64)
        c = torch.stack(self._windows).cpu().numpy()
        keep = c.reshape(c.shape[0], -1).sum(1) > 0
        last = int(np.nonzero(keep)[0][-1]) + 1 if keep.any() else 0
        return c[:last]

    def trace(self) -> Trace:
        """The recorded trace (summed over `process_group` if given; every rank must call)."""
        c_TLE = self.counts()
        meta = dict(self.meta)
        if self.process_group is not None:
            import torch.distributed as dist

            dev = self._windows[0].device if self._windows else torch.device("cpu")
            if dist.get_backend(self.process_group) == "nccl" and dev.type == "cpu":
                dev = torch.device("cuda", torch.cuda.current_device())
            # Ranks may have closed different numbers of windows (different token counts):
            # agree on the largest and pad with empty windows before summing.
            t = torch.tensor([c_TLE.shape[0]], dtype=torch.int64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            full = np.zeros((int(t.item()),) + c_TLE.shape[1:], dtype=np.int64)
            full[: c_TLE.shape[0]] = c_TLE
            s = torch.from_numpy(full).to(dev)
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.process_group)
            c_TLE = s.cpu().numpy()
            world = dist.get_world_size(self.process_group)
            meta["ranks_summed"] = world
        else:
            world = 1
        if c_TLE.shape[0] == 0:
            raise EplbError(
                "no tokens were routed while the collector was attached: run the model inside "
                "`with RouterCollector(...)`"
            )
        if self._top_k is not None:
            meta["top_k"] = self._top_k
        if self.window_tokens is not None:
            meta["tokens_per_window"] = self.window_tokens * world
        if meta.get("source") is None:
            meta["source"] = "eplb.runtime.collect.RouterCollector"
        topk, win = self._kept()
        if topk is not None:
            win = np.minimum(win, c_TLE.shape[0] - 1)
        return Trace(c_TLE, np.asarray(self.layer_ids, dtype=np.int64), meta, topk, win)

    def _kept(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per-token ids [N, L, K] of the first tokens every layer kept, and their windows [N]."""
        n = min(self._kept_n_L) if self.keep_tokens else 0
        if n == 0:
            return None, None
        per_layer = [torch.cat(parts)[:n].cpu() for parts in self._kept_L]
        ids_NLK = torch.stack(per_layer, dim=1).numpy()
        starts = np.asarray(self._win_start[1:], dtype=np.int64)
        win_N = np.searchsorted(starts, np.arange(n), side="right").astype(np.int32)
        return ids_NLK, win_N

    def save(self, path: str | Path) -> Trace:
        """Write the trace in eplb's .npz format; returns it."""
        t = self.trace()
        save_trace(t, path)
        return t


def collect_trace(model: nn.Module, batches, *, forward: Callable | None = None, **kwargs) -> Trace:
    """Run `model` (or `forward(batch)`) over `batches` under a RouterCollector; return the trace."""
    with RouterCollector(model, **kwargs) as rec, torch.no_grad():
        for b in batches:
            (forward or model)(b)
    return rec.trace()
