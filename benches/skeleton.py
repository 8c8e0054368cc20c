"""A bundle's graphs without their weights, and a bundle rebuilt from them with random weights.

For speed measurements on a machine that cannot receive the weights (a GPU host reached through a
transfer limit of tens of MB, where a wide-checkpoint bundle is gigabytes): `strip` writes the
bundle's manifest, tokenizer and graphs with every weight moved out to external data that is not
written (a few MB in all, plus `skeleton.json`: each graph's data files and whether its weights were
inline); `fill` writes those data files again with random values of each weight's type and shape,
puts inline weights back inline, and updates the manifest's sizes and sha256s, so that the runtime
loads the result as the bundle it was, with other weights. Speed does not depend on the values;
the images do, so they are not compared with anything.

    python benches/skeleton.py strip BUNDLE SKELETON
    python benches/skeleton.py fill SKELETON BUNDLE_OUT

Random values: a pool of 2^24 normal floats times 0.02 (the usual init scale), each tensor a slice
of it from a per-tensor offset, cast to the tensor's type; integer tensors are zeros.
"""

import argparse
import hashlib
import json
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import onnx
from onnx import external_data_helper, helper

SKELETON = "skeleton.json"
POOL = np.random.default_rng(0).standard_normal(1 << 24, dtype=np.float32) * 0.02


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def strip(bundle: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    manifest = json.loads((bundle / "manifest.json").read_text())
    graphs = {}
    for name in manifest["files"]:
        if not name.endswith(".onnx"):
            if not name.endswith(".data"):
                shutil.copyfile(bundle / name, out / name)
            continue
        model = onnx.load(str(bundle / name), load_external_data=False)
        inline = not any(external_data_helper.uses_external_data(t) for t in model.graph.initializer)
        if inline:  # every weight gets a place in the file that `fill` writes, then inlines again
            offset = 0
            for t in external_data_helper._get_all_tensors(model):
                if t.HasField("raw_data") and len(t.raw_data) >= 1024:
                    size = len(t.raw_data)
                    external_data_helper.set_external_data(t, f"{name}.data", offset, size)
                    t.ClearField("raw_data")
                    t.data_location = onnx.TensorProto.EXTERNAL
                    offset += size
        onnx.save(model, str(out / name))
        graphs[name] = {"inline": inline}
    shutil.copyfile(bundle / "manifest.json", out / "manifest.json")
    (out / SKELETON).write_text(json.dumps({"graphs": graphs}, indent=2) + "\n")
    print(f"{out}: {sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB")


def _values(tensor, count: int) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    if not np.issubdtype(dtype, np.floating):
        return np.zeros(count, dtype=dtype)
    start = zlib.crc32(tensor.name.encode()) % (POOL.size // 2)
    return np.resize(POOL[start:], count).astype(dtype)


def _fill_graph(skeleton: Path, out: Path, name: str, inline: bool) -> None:
    model = onnx.load(str(skeleton / name), load_external_data=False)
    files = {}
    for t in external_data_helper._get_all_tensors(model):
        if external_data_helper.uses_external_data(t):
            info = _external(t)
            files.setdefault(info["location"], []).append((t, int(info.get("offset", 0)), int(info["length"])))
    for location, tensors in files.items():
        with open(out / location, "wb") as f:
            for t, offset, length in tensors:
                count = length // np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
                f.seek(offset)
                f.write(_values(t, count).tobytes())
    shutil.copyfile(skeleton / name, out / name)
    if inline:
        model = onnx.load(str(out / name))  # reads the data written above
        onnx.save(model, str(out / name))
        for location in files:
            (out / location).unlink()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def fill(skeleton: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    graphs = json.loads((skeleton / SKELETON).read_text())["graphs"]
    manifest = json.loads((skeleton / "manifest.json").read_text())
    for name in manifest["files"]:
        if name not in graphs and (skeleton / name).exists():
            shutil.copyfile(skeleton / name, out / name)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: _fill_graph(skeleton, out, item[0], item[1]["inline"]), graphs.items()))
    missing = [n for n in manifest["files"] if not (out / n).exists()]
    if missing:
        sys.exit(f"{out}: not written: {missing}")
    with ThreadPoolExecutor(4) as pool:
        hashes = dict(zip(manifest["files"], pool.map(lambda n: _sha256(out / n), manifest["files"]), strict=True))
    for name, entry in manifest["files"].items():
        entry.update(bytes=(out / name).stat().st_size, sha256=hashes[name])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{out}: {sum(p.stat().st_size for p in out.iterdir()) / 1e9:.2f} GB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip", help="BUNDLE -> SKELETON (graphs without weights)")
    s.add_argument("bundle", type=Path)
    s.add_argument("out", type=Path)
    f = sub.add_parser("fill", help="SKELETON -> BUNDLE_OUT (random weights)")
    f.add_argument("skeleton", type=Path)
    f.add_argument("out", type=Path)
    a = p.parse_args()
    strip(a.bundle, a.out) if a.cmd == "strip" else fill(a.skeleton, a.out)


if __name__ == "__main__":
    main()
