# Sourced by the scripts: creates (once) and activates the pinned Python environment in .venv,
# with the export tool installed in editable mode. Needs python3 >= 3.10 and the PyPI registry.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A stamp of export/pyproject.toml: when its pins change, the environment is brought up to date.
_stamp="$_root/.venv/.pyproject.$(sha256sum "$_root/export/pyproject.toml" | cut -c1-16)"
if [ ! -e "$_stamp" ]; then
  [ -x "$_root/.venv/bin/python" ] || python3 -m venv "$_root/.venv"
  "$_root/.venv/bin/python" -m pip install --quiet --upgrade pip
  "$_root/.venv/bin/python" -m pip install --quiet -e "$_root/export[test]"
  rm -f "$_root"/.venv/.pyproject.* && touch "$_stamp"
fi
# shellcheck disable=SC1091
source "$_root/.venv/bin/activate"
