"""Expert-parallel shim against the single-device reference, with gloo on CPU (2 and 4 ranks).

One start per world size runs every case inside (start-up costs seconds): several placements
(contiguous with same-rank duplicates, random with replicas and weights, greedy), every
dispatch mode, uneven token counts per rank, weight moves checked bit for bit, and (4 ranks)
two 2-rank subgroups to prove the process group is honoured.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

pytestmark = pytest.mark.distributed

E, D, FF, K = 12, 16, 24, 3  # experts, model dim, expert hidden, top-k


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_moes(num_layers: int, seed: int = 0):
    """Single-device reference MoE layers (the model's own `MoE.routed` is the reference)."""
    from eplb.runtime.model import ModelConfig, MoE

    torch.manual_seed(seed)
    cfg = ModelConfig(hidden=D, num_logical_experts=E, top_k=K, num_expert_groups=4, topk_groups=2, expert_hidden=FF)
    return [MoE(cfg).requires_grad_(False) for _ in range(num_layers)]


def stacked(moe):
    return moe.w_gate_EFD.detach(), moe.w_up_EFD.detach(), moe.w_down_EDF.detach()


def tokens(rank: int, world: int, salt: int = 0):
    """Uneven token counts per rank (rank 0 may have very few), skewed expert choice."""
    g = torch.Generator().manual_seed(100 * rank + salt)
    T = 3 + 9 * rank + salt % 5
    x = torch.randn(T, D, generator=g)
    pop = torch.linspace(3.0, 0.2, E)  # expert 0 is hot
    ids = torch.stack([torch.multinomial(pop, K, replacement=False, generator=g) for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return x, ids, w


def placements(world: int, num_layers: int = 2):
    from eplb import plan
    from eplb.core.placement import Placement, contiguous_map
    from eplb.core.topology import Topology

    S = E // world + 1
    topo = Topology(num_gpus=world, slots_per_gpu=S)
    out = {"contiguous": Placement(contiguous_map(E, topo, num_layers), world, E)}
    rng = np.random.default_rng(world)
    rows, weights = [], []
    for _ in range(num_layers):
        # Random map with extra replicas; one expert may get two slots on one rank.
        row = np.concatenate([rng.permutation(E), rng.integers(0, E, world * S - E)])
        rng.shuffle(row)
        rows.append(row)
        w = rng.uniform(0.05, 1.0, world * S)
        sums = np.zeros(E)
        np.add.at(sums, row, w)
        weights.append(w / sums[row])
    out["random"] = Placement(np.stack(rows), world, E, dispatch_weights_LP=np.stack(weights))
    load = np.stack([np.linspace(30, 1, E) ** (1 + l) for l in range(num_layers)])
    out["greedy"] = plan(load, num_gpus=world, planner="greedy").placement
    return out


def _check_forward(placement, name, moes, group, modes, tol=1e-5):
    from eplb.runtime.ep import ExpertParallelMoE

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    for layer in range(placement.num_layers):
        wg, wu, wd = stacked(moes[layer])
        x, ids, w = tokens(rank, world, salt=layer)
        ref = moes[layer].routed(x, ids, w)
        for mode in modes:
            if mode == "weights" and placement.dispatch_weights_LP is None:
                continue
            moe = ExpertParallelMoE.from_full(placement, layer, wg, wu, wd, group=group, mode=mode)
            y = moe(x, ids, w)
            err = float((y - ref).abs().max()) if len(y) else 0.0
            assert err < tol, f"{name} layer {layer} mode {mode}: max abs err {err}"
            # Every row is computed exactly once somewhere in the group.
            n = torch.tensor([moe.last.rows_sent, moe.last.rows_received])
            dist.all_reduce(n, group=group)
            assert n[0] == n[1], f"{name} mode {mode}: sent {n[0]} rows, computed {n[1]}"


def _check_migration(old, new, moes, group):
    """Move weights old -> new in place; after every round each expert that serving(k) says is
    served must have its exact weights in those slots; at the end all slots match bit for bit."""
    from eplb.runtime.apply import migrate_weights, plan_migration

    rank = dist.get_rank(group)
    S = old.slots_per_gpu
    full = [stacked(m) for m in moes]

    def local_of(phy2log_LP):
        return {n: torch.stack([full[l][i][torch.as_tensor(phy2log_LP[l, rank * S:(rank + 1) * S])]
                                for l in range(len(phy2log_LP))]) for i, n in enumerate(("w_gate", "w_up", "w_down"))}

    for chunk in (None, 1):
        plan = plan_migration(old, new, layers_per_chunk=chunk)
        local = local_of(old.phy2log_LP)

        def served_intact(k, plan=plan, local=local):
            phy2log_LP, w_LP = plan.serving(k)
            ok = torch.tensor([1])
            for l in range(old.num_layers):
                for s in range(S):
                    p = rank * S + s
                    e = int(phy2log_LP[l, p])
                    if w_LP[l, p] > 0 and not all(torch.equal(local[n][l, s], full[l][i][e])
                                                  for i, n in enumerate(("w_gate", "w_up", "w_down"))):
                        ok[0] = 0
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
            assert ok.item() == 1, f"round {k}: a served slot does not hold its expert's weights"

        assert plan.num_transfers > 0
        migrate_weights(old, new, local, group=group, plan=plan, on_round=served_intact)
        want = local_of(new.phy2log_LP)
        for n in want:
            assert torch.equal(local[n], want[n]), f"tensor {n} differs after the move"


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        group = dist.group.WORLD
        modes = ["even", "weights", "local", "resplit"]
        ps = placements(world)
        moes = reference_moes(2)
        for name, p in ps.items():
            _check_forward(p, name, moes, group, modes)
        _check_migration(ps["contiguous"], ps["greedy"], moes, group)
        _check_migration(ps["random"], ps["contiguous"], moes, group)

        # A placement change through the layer objects themselves, then forward again.
        from eplb.runtime.apply import apply_placement
        from eplb.runtime.ep import ExpertParallelMoE
        eps = [ExpertParallelMoE.from_full(ps["contiguous"], l, *stacked(moes[l]), group=group) for l in range(2)]
        apply_placement(eps, ps["random"], mode="weights")
        from eplb.runtime.measure import Recorder
        rec = Recorder(2)
        sent = 0
        with rec.step():
            for l, m in enumerate(eps):
                x, ids, w = tokens(rank, world, salt=l)
                err = float((m(x, ids, w) - moes[l].routed(x, ids, w)).abs().max())
                assert err < 1e-5, f"after apply_placement layer {l}: max abs err {err}"
                rec.record(l, m.last)
                sent += m.last.rows_sent
        rep = rec.gather(group)
        total = torch.tensor([sent])
        dist.all_reduce(total, group=group)
        assert rep.rows_BLG.shape == (1, 2, world) and rep.rows_BLG.sum() == total.item()
        assert rep.step_s_BG.shape == (1, world) and np.all(rep.step_s_BG > 0)

        # Ranks that disagree on a placement or a plan get an error, not wrong rows or a hang.
        from eplb.errors import EplbError
        from eplb.runtime.apply import migrate_weights, plan_migration
        mine = ps["contiguous"] if rank % 2 else ps["greedy"]
        with pytest.raises(EplbError, match="different placements"):
            ExpertParallelMoE.from_full(mine, 0, *stacked(moes[0]), group=group)
        S = mine.slots_per_gpu
        local = {"w": torch.zeros(2, S, 1)}
        with pytest.raises(EplbError, match="different migration plans"):
            migrate_weights(ps["random"], mine, local, group=group, plan=plan_migration(ps["random"], mine))

        # Bad inputs on one rank raise EplbError on every rank (the others used to wait in the
        # all-to-all for it), and the group stays usable; a rank with no tokens takes part.
        last = world - 1
        for mode in ("even", "resplit"):
            ep = ExpertParallelMoE.from_full(ps["random"], 0, *stacked(moes[0]), group=group, mode=mode)
            x, ids, w = tokens(rank, world)
            bad = ids.clone()
            if rank == last:
                bad[0, 0] = E + 5
            mine = rf"outside 0\.\.{E - 1} \(first: {E + 5}\)" if rank == last else rf"rank\(s\) \[{last}\]"
            with pytest.raises(EplbError, match=mine):
                ep(x, bad, w)
            mine = "need integer expert ids" if rank == last else rf"rank\(s\) \[{last}\]"
            with pytest.raises(EplbError, match=mine):
                ep(x, ids.float() if rank == last else ids, w)
            if rank == 0:
                x, ids, w = x[:0], ids[:0], w[:0]
            y = ep(x, ids, w)
            assert y.shape == x.shape
            err = float((y - moes[0].routed(x, ids, w)).abs().max()) if len(y) else 0.0
            assert err < 1e-5, f"{mode} after refused inputs, rank 0 without tokens: max abs err {err}"

        # Ranks that recorded different numbers of steps: a named error on every rank (gloo
        # aborted the process, and the other ranks got a report of mixed-up rows).
        uneven = Recorder(1)
        for _ in range(2 if rank == 0 else 1):
            with uneven.step():
                pass
        with pytest.raises(EplbError, match=r"different \[steps, layers\]: \[\[2, 1\], \[1, 1\]"):
            uneven.gather(group)
        # A rank with no steps at all: it used to raise alone, leaving the others in all_gather.
        with pytest.raises(EplbError, match=r"different \[steps, layers\]: \[\[0, 1\], \[1, 1\]"):
            (Recorder(1) if rank == 0 else uneven).gather(group)

        subgroups = []
        if world == 4:
            # Two independent 2-rank groups: ranks in a group are not global ranks.
            subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            sub = subgroups[rank // 2]
            ps2 = placements(2)
            for name, p in ps2.items():
                _check_forward(p, f"subgroup {name}", moes, sub, modes)
            _check_migration(ps2["contiguous"], ps2["greedy"], moes, sub)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(out_dir, "done.json"), "w") as f:
                json.dump({"world": world, "modes": modes, "subgroups": len(subgroups)}, f)
        dist.destroy_process_group()
    except Exception:
        # mp.spawn shows only the exception type for some failures; keep the whole story.
        traceback.print_exc()
        raise


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_reference(world, tmp_path):
    # fork, not spawn: a spawned rank re-imports torch (~3 s of CPU each, 30-40 s for 4 ranks
    # on 2 loaded cores); forked ranks start in milliseconds. Ranks set one intra-op thread
    # first, so no OpenMP pool inherited from the parent is ever entered.
    mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="fork")
    done = json.loads((tmp_path / "done.json").read_text())
    assert done == {"world": world, "modes": ["even", "weights", "local", "resplit"],
                    "subgroups": 2 if world == 4 else 0}
