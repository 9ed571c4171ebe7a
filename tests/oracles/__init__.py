"""Reference twins of eplb kernels, kept as test oracles (not collected as tests)."""
