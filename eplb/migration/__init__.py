"""Migration: move a served placement to a new one cheaply (few copies) and safely (no gaps).

Legend: L = MoE layers, E = logical experts, G = GPUs (ranks), N = nodes, S = slots per GPU,
P = G x S physical slots, M = transfers, R = rounds. Slot p lives on GPU p // S.

Three parts:
1. Counting and relabelling (`moves`). A *move* is a replica copied onto a GPU that did not
   hold that expert before (in that layer); reshuffling slots inside a GPU is free.
   `count_moves` counts them; `relabel` renames the GPUs (and nodes) of a new plan so that it
   keeps as many old replicas as possible, and `keep_slots` keeps every replica that stays
   on its GPU in its old slot.
2. Migration-aware planning. `budgeted_search` (`search`) starts from the old placement and
   applies the replica changes that lower each layer's busiest GPU most per move, until a
   `Budget` is spent or no change buys at least `move_cost`. `migrate` (`adapt`) combines
   relabelling and search; `restore_missing` gives experts lost with failed ranks a replica;
   `adapt_solution` is the front door's migration step on a planner's Solution; under a rule
   whose shares follow the layout (SGLang's) `migrate_for_rule` (`rule`) judges every
   candidate by binding that rule, and `repair_swaps` buys only swaps that keep its shares.
3. Scheduling (`schedule`, `plan`). `schedule` orders the copies into rounds in which every
   rank sends at most one and receives at most one expert, such that every logical expert
   keeps at least one complete replica serving tokens at every moment; the result is a
   `MigrationPlan`, whose `serving(k)` gives the placement to serve with during round k.
   Cycles (two GPUs exchanging the only replicas of two experts) are broken by *staging*
   one expert through a slot whose own expert has another complete replica.

The hot loops are kernels (`eplb.core.jit`: compiled by numba, interpreted until then); the
package imports only eplb.errors, eplb.core.placement, eplb.stats and, for `rule`, eplb.dispatch.sglang
(and numpy, numba).
"""

from eplb.migration.adapt import adapt_solution, max_load, migrate, restore_missing
from eplb.migration.moves import count_moves, holdings, keep_slots, relabel
from eplb.migration.plan import CHECKPOINT, MigrationPlan
from eplb.migration.rule import layout_dependent
from eplb.migration.schedule.rounds import schedule
from eplb.migration.search import Budget, budgeted_search

__all__ = [
    "CHECKPOINT", "Budget", "MigrationPlan", "adapt_solution", "budgeted_search", "count_moves", "holdings",
    "keep_slots", "layout_dependent", "max_load", "migrate", "relabel", "restore_missing", "schedule",
]
