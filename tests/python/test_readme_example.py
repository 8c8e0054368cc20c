"""The README's Python example, run as a user copies it: in an empty directory, with no model
named (the bundled tiny model). It writes the image `klein generate` writes for the same prompt,
size and seed."""

import os
import re
import subprocess
import sys
from pathlib import Path

from PIL import Image


def readme_python_example(repo: Path) -> str:
    readme = (repo / "README.md").read_text()
    section = readme.split("\n## Python\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under the README's ## Python"
    return match.group(1)


def test_readme_python_example_runs_and_gives_the_cli_image(repo, klein_bin, tmp_path):
    code = readme_python_example(repo)
    env = {k: v for k, v in os.environ.items() if k != "KLEIN_MODEL"}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=300)
    made = tmp_path / "fox.png"
    assert Image.open(made).size == (256, 256)
    cli = tmp_path / "cli.png"
    args = ["generate", "a red fox in the snow", "--width", "256", "--height", "256", "--seed", "7", "-q"]
    subprocess.run([str(klein_bin), *args, "-o", str(cli)], env=env, check=True, timeout=300)
    # The pixels, not the files: the CLI stores its metadata in the PNG, PIL's save() none.
    assert Image.open(made).tobytes() == Image.open(cli).convert("RGB").tobytes()
