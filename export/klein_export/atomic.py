"""Bundles are written whole or not at all: into a temporary sibling directory, renamed into place."""

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _remove_stale_partials(out: Path):
    """Temporary directories of writers whose process is gone (killed, e.g. out of memory)."""
    if not sys.platform.startswith("linux"):
        return
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _readable_files(directory: Path):
    """Gives every file the mode a new file gets under the umask (0644 usually). onnx writes
    external-data files 0600, which makes a bundle copied to a shared or system location unreadable
    to its other users."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def check_output(out, force, inputs=(), replaceable=lambda d: (d / "manifest.json").is_file(), error=None):
    """Refuses `--out` before any work where writing it would fail or lose data: under a file, a
    file itself, the same as or a folder holding one of `inputs` (each `(path, what)`), or existing
    without `force`; and with `force`, a directory that is not what this command writes
    (`replaceable(directory)`: by default a klein bundle) and not empty, since it is deleted."""
    from .errors import OutputExistsError

    error = error or OutputExistsError
    out = Path(out)
    resolved = out.resolve()
    for path, what in inputs:
        path = Path(path).resolve()
        if resolved == path or resolved in path.parents:
            raise error(f"{out}: the output would replace {what} {path}; give another --out")
        if path in resolved.parents and path.is_dir():
            raise error(f"{out}: the output would be written inside {what} {path}; give an --out outside it")
    above = next((p for p in [out, *out.parents] if p.exists()), None)
    if above is not None and above != out and not above.is_dir():
        raise error(f"{out}: {above} is a file, not a directory; give an --out in a directory")
    # The output is written beside `out` first: the nearest folder that exists must take a new one.
    holder = next((p for p in resolved.parents if p.exists()), Path("/"))
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".klein-probe-", dir=holder))
    except OSError as e:
        raise error(
            f"{out}: cannot write in {holder} ({e.strerror or e}); give an --out in a directory you can write"
        ) from None
    if not out.exists():
        return
    if not out.is_dir():
        raise error(f"{out}: is a file, not a directory; give another --out")
    if not force:
        raise error(f"{out}: already exists; pass --force to replace it")
    if any(out.iterdir()) and not replaceable(out):
        raise error(
            f"{out}: --force replaces only what this command writes, and this directory holds something "
            "else; give a new or empty --out"
        )


@contextmanager
def atomic_directory(out):
    """Yields an empty temporary directory beside `out`; when the block completes it replaces `out`,
    and when it raises it is removed, so `out` is never half-written."""
    from .errors import KleinExportError

    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise KleinExportError(
            f"{out}: cannot write there ({e.strerror or e}); give an --out in a directory you can write"
        ) from None
    try:
        yield tmp
        _readable_files(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
