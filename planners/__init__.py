"""Built-in planners, one module per algorithm (greedy, robust, ...).

Nothing is imported here: the front door finds each planner through the static table in
`planners.api.PLANNERS` and imports its module on first use.
"""
