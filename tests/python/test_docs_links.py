"""Every relative link of the user docs resolves: the file it names exists, and a `#anchor` names a
heading of that Markdown file, as GitHub makes heading anchors (lower case, punctuation dropped,
spaces to hyphens, `-1`, `-2`... for repeats)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "onnx" / "README.md", REPO / "benches" / "RESULTS.md", *(REPO / "docs").glob("*.md")]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(path: Path) -> set[str]:
    """The heading anchors of the Markdown file at `path`."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for link in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.name}")
    return broken


def test_every_relative_link_and_anchor_resolves():
    assert len(DOCS) >= 4
    broken = {str(p.relative_to(REPO)): b for p in DOCS if (b := broken_links(p))}
    assert not broken, broken


def test_the_checker_sees_broken_anchors_and_files(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## A section\n\n## A section\n\n```\n# not a heading\n```\n\n"
        "[ok](#a-section) [repeat](#a-section-1) [code](#not-a-heading) [gone](missing.md) [self](page.md#title)\n"
    )
    assert broken_links(page) == [
        "#not-a-heading: no heading #not-a-heading in page.md",
        f"missing.md: no file {tmp_path / 'missing.md'}",
    ]
