"""Every file eplb reads or writes: traces, placements, engine exports (the edge of the pipeline).

The core speaks Trace and Placement values; this package converts them at the edge:
- `load_trace(path)`, `load_history(paths)`: any supported trace file (eplb.formats.detect);
- `save_trace(trace, path)`: eplb's `.npz` (eplb.formats.native);
- `load_placement(path)`, `save_placement(placement, path)`: eplb's placement JSON;
- `write_placement(placement, path, fmt)`, `read_placement(path, fmt)`: eplb or an engine's
  format (SGLang, vLLM, TensorRT-LLM; eplb.formats.export);
- `write_replay(result, path)`, `read_replay(path)`: what `eplb replay -o` writes (eplb.formats.replay).
torch (vLLM/SGLang `.pt`) and PyYAML (TensorRT-LLM) are imported only by the readers and
writers that need them.
"""

from eplb.formats.detect import load_history, load_trace
from eplb.formats.export import FORMATS, read_placement, write_placement
from eplb.formats.native import load_placement, read_json_file, save_placement, save_trace
from eplb.formats.replay import read_replay, write_replay

__all__ = ["FORMATS", "load_history", "load_placement", "load_trace", "read_json_file", "read_placement",
           "read_replay", "save_placement", "save_trace", "write_placement", "write_replay"]
