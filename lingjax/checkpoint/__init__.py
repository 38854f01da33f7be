"""Checkpoint I/O: the official safetensors layout (checked whole, then streamed; fp8 kept in fp8 on the device) and
lingjax's own orbax format.

    names        the one name table from checkpoint keys to parameter paths; CheckpointError
    safetensors  load_safetensors: every header checked before any data is read, then one parameter at a time
    fp8          the official fp8 layout: its checks, what stays fp8 on the device, what the writers quantize
    params       the parameter tree both loaders fill: get/set by path, the NaN/inf refusal, the merge
    orbax        lingjax's own format, the fast load path: save_orbax, load_orbax
    conversion   `lingjax convert`: convert (to orbax), convert_fp8 (to the fp8 layout)
    writer       save_safetensors, the official layout written from a model, for test checkpoints

The names re-exported here are those the rest of lingjax, its tests and benches use; the package is one door to
checkpoints, and `checkpoint.load_safetensors(...)` reads as well as a deeper import.
"""

from lingjax.checkpoint.conversion import convert, convert_fp8
from lingjax.checkpoint.fp8 import FP8_DTYPE, SCALE_SUFFIX, read_fp8_config
from lingjax.checkpoint.names import INDEX_FILE, CheckpointError, TensorSpec, tensor_table
from lingjax.checkpoint.orbax import is_orbax, load_orbax, save_orbax
from lingjax.checkpoint.safetensors import WEIGHTS, load_safetensors
from lingjax.checkpoint.writer import save_safetensors

__all__ = [
    "FP8_DTYPE", "INDEX_FILE", "SCALE_SUFFIX", "WEIGHTS", "CheckpointError", "TensorSpec", "convert", "convert_fp8",
    "is_orbax", "load_orbax", "load_safetensors", "read_fp8_config", "save_orbax", "save_safetensors", "tensor_table",
]
