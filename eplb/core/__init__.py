"""The values every layer speaks, and the plumbing under them.

- `topology`: `Topology` (GPUs, nodes, slots per GPU);
- `trace`: `Trace` (router counts per window, layer ids, meta);
- `placement`: `Placement` (which logical expert each physical slot holds), per-GPU loads,
  the contiguous baseline;
- `hardware`: `Hardware` profiles (presets and profile files);
- `files`: atomic writes and bounded reads (every file eplb touches goes through it);
- `progress`: progress lines on stderr;
- `jit`: the compiled kernels' decorator and argument types.
"""
