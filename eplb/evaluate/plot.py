"""Figures for operators: expert-load heatmap, GPU load before/after, replica map (timelines:
eplb/evaluate/timeline.py).

Legend: T = time windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots.
Loads are token-slot counts (a token routed to K experts counts K times).

Every function builds a matplotlib `Figure` without pyplot (so nothing global changes and no
display is needed: headless by construction), returns it, and writes it when given `path`;
the file type follows the extension (.png, .svg or .pdf). matplotlib is imported inside the
functions: importing this module costs nothing. Plots draw what they are given (loads,
placements, backtest results); the commands compute it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from eplb import stats
from eplb.core.outputs import write_bytes
from eplb.errors import EplbError

FORMATS = (".png", ".svg", ".pdf")
DPI = 110
# One colour per series, the same planner always the same colour within a figure; the
# contiguous baseline is grey so the planners stand out against it.
BASELINE_COLOUR = "#7f7f7f"
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    return fig


def check_figure_path(path: str | Path) -> Path:
    """`path` if its extension names a figure format (PNG, SVG or PDF); checked before drawing."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise EplbError(f"cannot write a figure to {str(path)!r}: use a file name ending in "
                        f"{', '.join(FORMATS)}")
    return path


def save(fig, path: str | Path) -> Path:
    """Write a figure; the extension picks the format (PNG, SVG or PDF)."""
    path = check_figure_path(path)
    # Agg canvas explicitly: works with no display and whatever backend the user configured.
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    # Drawn in memory, then written atomically: a failed write never leaves half a figure.
    buf = io.BytesIO()
    ext = path.suffix.lower()
    fig.savefig(buf, format=ext[1:], dpi=DPI, metadata={"Software": "eplb"} if ext == ".png" else None)
    write_bytes(path, buf.getvalue(), what="the figure")
    return path


def _loads(load_LE: Any) -> np.ndarray:
    a = np.asarray(getattr(load_LE, "counts_TLE", load_LE), dtype=np.float64)
    if a.ndim == 3:  # a trace or [T, L, E] counts: plot the sum over windows
        a = a.sum(axis=0)
    if a.ndim != 2 or 0 in a.shape:
        raise EplbError(f"loads must be [layers, experts] (or [windows, layers, experts]), got shape {a.shape}")
    if not np.all(np.isfinite(a)) or a.min() < 0:
        raise EplbError("loads must be finite and non-negative")
    return a


def _layer_ids(layer_ids, L: int, source: Any = None) -> np.ndarray:
    if layer_ids is None:
        layer_ids = getattr(source, "layer_ids", None)
    ids = np.arange(L) if layer_ids is None else np.asarray(layer_ids)
    if ids.shape != (L,):
        raise EplbError(f"layer_ids must have {L} entries (one per MoE layer), got shape {ids.shape}")
    return ids


def _finish(fig, path):
    if path is not None:
        save(fig, path)
    return fig


# 1. Expert-load heatmap ---------------------------------------------------------------------------

def expert_heatmap(load_LE: Any, *, layer_ids=None, title: str | None = None, path=None):
    """Layer x expert heatmap of load relative to the layer mean, log colour scale.

    load_LE: [L, E] loads, [T, L, E] counts or a Trace (windows summed). Colour is load /
    mean expert load of that layer, so 1 is "fair share" and hot experts stand out in every
    layer whatever its volume; experts with no tokens are drawn grey.
    """
    from matplotlib.colors import LogNorm

    load = _loads(load_LE)
    L, E = load.shape
    ids = _layer_ids(layer_ids, L, load_LE)
    mean_L = load.mean(axis=1, keepdims=True)
    ratio = np.where(mean_L > 0, load / np.where(mean_L > 0, mean_L, 1), 0.0)
    pos = ratio[ratio > 0]
    if pos.size == 0:
        raise EplbError("every load is zero: nothing to plot")
    # Sequential map, log scale: the floor sits well below fair share (1) so cold experts stay
    # dark and only the hot ones light up.
    vmax = max(float(pos.max()), 2.0)
    vmin = min(max(float(pos.min()), 1.0 / 16), 0.5)
    fig = _figure(10, 5.2)
    ax = fig.add_subplot()
    from matplotlib import colormaps

    cmap = colormaps["magma"].with_extremes(bad="#4a4a4a")
    im = ax.imshow(np.ma.masked_less_equal(ratio, 0), aspect="auto", interpolation="nearest", cmap=cmap,
                   norm=LogNorm(vmin=vmin, vmax=vmax, clip=True), extent=(-0.5, E - 0.5, L - 0.5, -0.5))
    step = max(1, L // 12)
    ax.set_yticks(np.arange(0, L, step), [str(int(i)) for i in ids[::step]])
    ax.set_xlabel("logical expert id")
    ax.set_ylabel("MoE layer (hidden-layer index)")
    hot = ratio.max(axis=1)
    ax.set_title(title or f"Expert load per layer: hottest expert {np.median(hot):.1f}x the layer mean "
                          f"(median over {L} layers, max {hot.max():.1f}x)")
    cb = fig.colorbar(im, ax=ax, pad=0.01)
    cb.set_label("expert load / layer mean (log scale)")
    return _finish(fig, path)


# 2. GPU load before/after ---------------------------------------------------------------------------

def _placement(obj: Any):
    pl = getattr(obj, "placement", obj)  # a PlanResult or a Placement
    if not hasattr(pl, "gpu_loads"):
        raise EplbError(f"expected a Placement or PlanResult, got {type(obj).__name__}")
    return pl


def gpu_load_comparison(load_LE: Any, placements: Mapping[str, Any], *, layer_ids=None,
                        title: str | None = None, path=None):
    """Busiest GPU / mean GPU per layer for each placement, plus the lower bound.

    placements: name -> Placement (or PlanResult), all on the same GPUs; add the contiguous
    placement under a name containing "contiguous" to show "before". Left: the ratio per
    layer; right: its spread over layers for the planners (box and every layer as a dot).
    """
    load = _loads(load_LE)
    L, E = load.shape
    ids = _layer_ids(layer_ids, L, load_LE)
    if not placements:
        raise EplbError("give at least one placement to compare")
    ratios: dict[str, np.ndarray] = {}
    num_gpus = None
    for name, obj in placements.items():
        pl = _placement(obj)
        if num_gpus is not None and pl.num_gpus != num_gpus:
            raise EplbError(f"placement {name!r} is for {pl.num_gpus} GPUs, the others for {num_gpus}: "
                            f"compare like with like")
        num_gpus = pl.num_gpus
        ratios[name] = stats.imbalance(pl.gpu_loads(load))
    first = _placement(next(iter(placements.values())))
    mean_L = load.sum(axis=1) / first.num_gpus
    bound_L = stats.lower_bound(load, first.num_gpus, first.num_slots) / np.where(mean_L > 0, mean_L, 1)

    colours = _colours(ratios)
    fig = _figure(11, 4.6)
    left, right = fig.subplots(1, 2, width_ratios=(2.3, 1))
    x = np.arange(L)
    for name, r in ratios.items():
        left.plot(x, r, marker="o", ms=3, lw=1.2, color=colours[name], label=f"{name} (median {np.median(r):.3f})")
    left.plot(x, bound_L, ls="--", lw=1, color="black", label=f"lower bound (median {np.median(bound_L):.3f})")
    step = max(1, L // 12)
    left.set_xticks(x[::step], [str(int(i)) for i in ids[::step]])
    left.set_xlabel("MoE layer (hidden-layer index)")
    left.set_ylabel("busiest GPU / mean GPU load (1 = perfect)")
    left.axhline(1.0, color="black", lw=0.5)
    left.legend(fontsize=8, loc="upper right")
    left.grid(alpha=0.3)

    # The right panel zooms in on the planners: next to the contiguous baseline (often 2-5x)
    # their differences (a few per cent) would be invisible.
    names = [n for n in ratios if "contiguous" not in n.lower()] or list(ratios)
    right.boxplot([ratios[n] for n in names], widths=0.5, showfliers=False)
    rng = np.random.default_rng(0)  # fixed jitter: the same figure every run
    for i, n in enumerate(names, start=1):
        right.scatter(i + rng.uniform(-0.15, 0.15, L), ratios[n], s=8, alpha=0.6, color=colours[n], zorder=3)
    right.set_xticks(np.arange(1, len(names) + 1), names, rotation=20, ha="right")
    right.set_ylabel("busiest / mean GPU, one dot per layer")
    right.set_title("planners, zoomed in", fontsize=10)
    right.axhline(1.0, color="black", lw=0.5)
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title or f"GPU load balance on {first.num_gpus} GPUs, {first.num_slots} slots "
                          f"({first.num_slots - E} redundant)")
    return _finish(fig, path)


def _colours(names) -> dict[str, str]:
    out, k = {}, 0
    for n in names:
        if "contiguous" in n.lower():
            out[n] = BASELINE_COLOUR
        else:
            out[n] = PALETTE[k % len(PALETTE)]
            k += 1
    return out


# 3. Replica map ----------------------------------------------------------------------------------

def replica_map(placement: Any, load_LE: Any = None, *, layer: int | None = None, title: str | None = None,
                path=None):
    """Which expert has how many replicas, per layer, and where they sit in one layer.

    Left: replicas per logical expert for every layer (layer x expert, 1 = no redundancy).
    Right: one layer's GPUs as stacked bars, one segment per slot, replicated experts coloured
    by their replica count and labelled with their id. With `load_LE` the bars are the tokens
    each slot serves (and the default layer is the one with the hottest expert); without,
    each slot is one unit high.
    """
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap

    pl = _placement(placement)
    L, P, G, S, E = pl.num_layers, pl.num_slots, pl.num_gpus, pl.slots_per_gpu, pl.num_logical_experts
    cnt_LE = pl.replica_count_LE
    X = int(cnt_LE.max())
    load = None
    if load_LE is not None:
        load = _loads(load_LE)
        if load.shape != (L, E):
            raise EplbError(f"loads have shape {load.shape}, the placement needs {(L, E)} [layers, experts]")
    if layer is None:
        layer = int(np.argmax(load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12))) if load is not None else 0
    if not 0 <= int(layer) < L:
        raise EplbError(f"layer index {layer} is outside 0..{L - 1} (an index into the MoE layers, "
                        f"not a hidden-layer id)")
    layer = int(layer)

    # Discrete colours: 1 replica light grey, 2..X from a sequential map.
    base = colormaps["viridis"].resampled(max(X - 1, 1))
    colours = ["#e0e0e0"] + [base(i) for i in range(max(X - 1, 1))][: X - 1]
    cmap = ListedColormap(colours if X > 1 else ["#e0e0e0"])
    norm = BoundaryNorm(np.arange(0.5, X + 1.5), cmap.N)

    fig = _figure(12, 5.2)
    left, right = fig.subplots(1, 2, width_ratios=(1.3, 1))
    im = left.imshow(cnt_LE, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                     extent=(-0.5, E - 0.5, L - 0.5, -0.5))
    step = max(1, L // 12)
    left.set_yticks(np.arange(0, L, step), [str(int(i)) for i in pl.layer_ids[::step]])
    left.set_xlabel("logical expert id")
    left.set_ylabel("MoE layer (hidden-layer index)")
    left.set_title(f"replicas per expert ({P - E} redundant slots per layer)")
    cb = fig.colorbar(im, ax=left, ticks=np.arange(1, X + 1), pad=0.01)
    cb.set_label("replicas")
    left.axhline(layer, color="red", lw=0.8, ls=":")

    phy2log_GS = pl.phy2log_LP[layer].reshape(G, S)
    if load is not None:
        h_GS = pl.slot_loads(load)[layer].reshape(G, S)
        ylabel = "tokens served (token-slots)"
    else:
        h_GS = np.ones((G, S))
        ylabel = "slots"
    cnt_GS = cnt_LE[layer][phy2log_GS]
    bottom = np.zeros(G)
    gx = np.arange(G)
    tall = h_GS.sum(axis=1).max() * 0.04
    for s in range(S):
        c = [colours[k - 1] for k in cnt_GS[:, s]]
        right.bar(gx, h_GS[:, s], bottom=bottom, color=c, edgecolor="white", linewidth=0.4, width=0.85)
        for g in range(G):
            if cnt_GS[g, s] > 1 and h_GS[g, s] >= tall and G <= 64:
                right.text(g, bottom[g] + h_GS[g, s] / 2, str(phy2log_GS[g, s]), ha="center", va="center",
                           fontsize=6, color="white" if cnt_GS[g, s] > 2 else "black", rotation=90)
        bottom += h_GS[:, s]
    if load is not None:
        right.axhline(bottom.mean(), color="black", lw=0.8, ls="--", label="mean GPU")
        right.legend(fontsize=8, loc="upper right")
    right.set_xlabel("GPU (rank)")
    right.set_ylabel(ylabel)
    right.set_title(f"layer {int(pl.layer_ids[layer])}: one bar segment per slot\n(labels: ids of replicated experts)")
    if title:
        fig.suptitle(title)
    return _finish(fig, path)
