"""`COREML_CACHE_KEY` in every graph: the key ONNX Runtime's CoreML provider files its compiled model
under in `ModelCacheDirectory` (`klein --coreml-cache`).

Without it the provider keys the cache on a hash of the graph's *path* and never checks whether the
file changed: a bundle exported again to the same directory would run the old compiled model. The
key is the sha256 of the graph's proto (without the key) and of every external-data file it
references, so it changes with the structure, the static shapes and the weights. The provider takes
letters and digits only, 64 at most: a sha256 hex digest is exactly that.
"""

import hashlib
from pathlib import Path

import onnx

KEY = "COREML_CACHE_KEY"


def _file_sha256(path: Path, cache: dict) -> str:
    if path not in cache:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        cache[path] = digest.hexdigest()
    return cache[path]


def _external_files(model) -> list:
    files = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            files |= {entry.value for entry in tensor.external_data if entry.key == "location"}
    return sorted(files)


def stamp(path: Path, data_hashes: dict = None) -> str:
    """Writes the key into the graph at `path` (its weights untouched); returns the key."""
    path = Path(path)
    data_hashes = {} if data_hashes is None else data_hashes
    model = onnx.load(str(path), load_external_data=False)
    kept = [p for p in model.metadata_props if p.key != KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    digest = hashlib.sha256(model.SerializeToString(deterministic=True))
    for location in _external_files(model):
        digest.update(location.encode())
        digest.update(_file_sha256(path.parent / location, data_hashes).encode())
    key = digest.hexdigest()
    model.metadata_props.add(key=KEY, value=key)
    onnx.save_model(model, str(path))
    return key


def stamp_bundle(bundle_dir, files=None) -> dict:
    """Stamps `files` (default: every `.onnx` file of the bundle); returns {file: key}."""
    bundle_dir = Path(bundle_dir)
    names = sorted(files) if files is not None else sorted(p.name for p in bundle_dir.glob("*.onnx"))
    data_hashes = {}
    return {name: stamp(bundle_dir / name, data_hashes) for name in names}
