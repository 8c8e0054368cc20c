"""Copies an x86-64 ELF file (a shared library or a program) with every `cpuid` instruction replaced
by `ud2`, for benches/avx2-host.sh on hosts without CPUID faulting: the preloaded
benches/avx2_host.c then answers each `ud2` in such a copy (SIGILL) with the masked CPUID values.

    python benches/avx2_patch.py SOURCE DEST

The instructions are found by disassembling the executable sections (`objdump -d`), not by
searching bytes, and each site is checked to read 0f a2 before it is written; `readelf -SW` maps
addresses to file offsets. Prints how many sites it patched; exits 2 when there is nothing to patch
or a site does not hold a `cpuid`.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

CPUID = b"\x0f\xa2"
UD2 = b"\x0f\x0b"


class PatchError(Exception):
    pass


def sections(path: Path) -> list:
    """[(address, file offset, size)] of the sections `readelf -SW` lists as executable."""
    out = subprocess.run(["readelf", "-SW", str(path)], check=True, capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        # [Nr] Name Type Address Off Size ES Flg ...
        m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)\s+\S+\s+(\S*)", line)
        if m and "X" in m.group(5):
            found.append((int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16)))
    return found


def cpuid_sites(path: Path) -> list:
    """Addresses of the `cpuid` instructions in the executable sections."""
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)], check=True, capture_output=True, text=True
    ).stdout
    return [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+cpuid\s*$", out, re.MULTILINE)]


def patch(source: Path, dest: Path) -> int:
    data = bytearray(source.read_bytes())
    secs = sections(source)
    sites = cpuid_sites(source)
    if not sites:
        raise PatchError(f"{source}: no cpuid instruction found")
    for address in sites:
        offset = next((off + address - addr for addr, off, size in secs if addr <= address < addr + size), None)
        if offset is None or data[offset : offset + 2] != CPUID:
            raise PatchError(f"{source}: no cpuid at {address:#x}")
        data[offset : offset + 2] = UD2
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    shutil.copymode(source, tmp)
    tmp.replace(dest)
    return len(sites)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    source, dest = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        n = patch(source, dest)
    except (PatchError, OSError, subprocess.CalledProcessError) as e:
        print(f"avx2_patch: {e}", file=sys.stderr)
        return 2
    print(f"avx2_patch: {dest}: {n} cpuid instructions now ud2", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
