"""`klein-export --help` and a mistyped flag answer without importing torch, onnx or ONNX Runtime
(seconds each): the command line reads its choices from options.py, and each command imports what
it needs when it runs. Checked in a fresh interpreter, where nothing is imported yet."""

import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime", "diffusers", "transformers")

PROBE = """
import sys
from klein_export.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = None
print(code, [m for m in {heavy!r} if m in sys.modules])
"""


def _run(*args):
    probe = PROBE.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1], out.stderr


def test_help_imports_no_heavy_module():
    line, _ = _run("--help")
    assert line == "0 []", line
    line, _ = _run("quantize", "--help")
    assert line == "0 []", line


def test_a_bad_flag_is_refused_before_any_heavy_import():
    line, err = _run("quantize", "--bundle", "b", "--out", "o", "--quantize", "int3")
    assert line == "2 []", line
    assert "invalid choice: 'int3'" in err
