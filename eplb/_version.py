"""The package version (one place: eplb.__version__ and `eplb --version` read it)."""

__version__ = "0.1.0"
