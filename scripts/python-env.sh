# Sourced by the scripts: creates (once) and activates the pinned Python environment in .venv,
# with the export tool installed in editable mode. Needs python3 >= 3.10 and the PyPI registry.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$_root/.venv/bin/klein-export" ] || [ ! -x "$_root/.venv/bin/ruff" ]; then
  python3 -m venv "$_root/.venv"
  "$_root/.venv/bin/python" -m pip install --quiet --upgrade pip
  "$_root/.venv/bin/python" -m pip install --quiet -e "$_root/export[test]"
fi
# shellcheck disable=SC1091
source "$_root/.venv/bin/activate"
