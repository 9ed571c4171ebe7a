"""One module per CLI command: `add_parser(subparsers)` and `run(args) -> int`.

Shared helpers for commands live in `eplb/commands/common.py`.
"""
