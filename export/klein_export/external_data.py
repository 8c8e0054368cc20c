"""Reading and writing an ONNX graph's weights one tensor at a time, for graphs larger than memory.

`onnx.load` reads every external weight into the protobuf, which the Python protobuf runtime does not
give back tensor by tensor: the full-size 4B transformer (15.5 GB in float32) would need more than a
24 GB machine has to be rewritten that way. Here a graph is loaded without its weights
(`load_structure`), each weight is read from its file when needed (`read_tensor`: plain file reads,
no memory map, so nothing stays resident), and a new weights file is written tensor by tensor
(`DataWriter`), aligned as `onnx.save_model` aligns (64 KiB for tensors of 1 MiB or more, so that
ONNX Runtime can map them).
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import BundleError

ALIGN_THRESHOLD = 1 << 20  # onnx.save_model's align_threshold
ALIGNMENT = 1 << 16  # onnx.save_model's allocation_granularity


def load_structure(path: Path) -> onnx.ModelProto:
    """The graph at `path` with its external weights left on disk (their `external_data` entries kept);
    BundleError naming the file when it is missing or not an ONNX graph."""
    return load_graph(path, weights=False)


def load_graph(path: Path, weights: bool = True) -> onnx.ModelProto:
    """The graph at `path` (with its external weights unless `weights` is False); BundleError naming
    the file when it is missing or cannot be read as an ONNX graph."""
    if not Path(path).is_file():
        raise BundleError(f"{path}: missing (a graph of the bundle's manifest); export the bundle again")
    try:
        return onnx.load(str(path), load_external_data=weights)
    except Exception as e:  # protobuf's DecodeError, onnx's errors, a missing external-data file
        raise BundleError(f"{path}: not a readable ONNX graph ({type(e).__name__}: {e})") from e


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of `tensor`'s values, wherever they are stored."""
    if is_external(tensor):
        return int(_external_entries(tensor)["length"])
    count = int(np.prod(tensor.dims, dtype=np.int64))
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def read_tensor(tensor: onnx.TensorProto, base_dir: Path) -> np.ndarray:
    """`tensor`'s values as an array of its shape: read from its external file (`base_dir` holds it)
    or from the protobuf."""
    if not is_external(tensor):
        return numpy_helper.to_array(tensor)
    entries = _external_entries(tensor)
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims, dtype=np.int64))
    with open(Path(base_dir) / entries["location"], "rb") as f:
        f.seek(int(entries.get("offset", 0)))
        values = np.fromfile(f, dtype=dtype, count=count)
    if values.size != count:
        raise onnx.checker.ValidationError(
            f"{Path(base_dir) / entries['location']}: too short for tensor {tensor.name!r} {list(tensor.dims)}"
        )
    return values.reshape(tuple(tensor.dims))


def _external_entries(tensor: onnx.TensorProto) -> dict:
    return {e.key: e.value for e in tensor.external_data}


class DataWriter:
    """A context manager that appends tensors to a new weights file at `path`; the tensors it returns
    name `location` (the file's final name, next to the graph), so the file can be written under a
    temporary name first."""

    def __init__(self, path: Path, location: str):
        self.path, self.location = Path(path), location
        self.file, self.offset = None, 0

    def __enter__(self):
        self.file = self.path.open("wb")
        return self

    def __exit__(self, *_exc):
        self.file.close()

    def add(self, name: str, values: np.ndarray) -> onnx.TensorProto:
        """Writes `values` and returns the external tensor `name` that refers to them."""
        values = np.asarray(values, order="C")  # not ascontiguousarray: it makes a scalar 1-D
        if values.nbytes >= ALIGN_THRESHOLD and self.offset % ALIGNMENT:
            pad = ALIGNMENT - self.offset % ALIGNMENT
            self.file.write(b"\0" * pad)
            self.offset += pad
        tensor = onnx.TensorProto(name=name, dims=values.shape)
        tensor.data_type = helper.np_dtype_to_tensor_dtype(values.dtype)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", self.offset), ("length", values.nbytes)):
            tensor.external_data.add(key=key, value=str(value))
        self.file.write(values.tobytes())
        self.offset += values.nbytes
        return tensor
