"""Safe rounds of weight copies from one placement to another (`rounds`: the Python side;
`_rounds_kernel` and its stages `_state_kernel`, `_senders_kernel`, `_links_kernel`,
`_cycles_kernel`, `_stage_kernel`: the compiled loop)."""

from eplb.migration.schedule.rounds import (
    CANDIDATES_PER_RANK,
    NO_SAFE_MIGRATION,
    RELAY_CANDIDATES_PER_RANK,
    RELAY_GATE,
    RELAY_SLOTS_PER_GPU,
    ScheduleThread,
    check_schedule_input,
    plan_from_rows,
    schedule,
    schedule_trusted,
)

__all__ = [
    "CANDIDATES_PER_RANK",
    "NO_SAFE_MIGRATION",
    "RELAY_CANDIDATES_PER_RANK",
    "RELAY_GATE",
    "RELAY_SLOTS_PER_GPU",
    "ScheduleThread",
    "check_schedule_input",
    "plan_from_rows",
    "schedule",
    "schedule_trusted",
]
