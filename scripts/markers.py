"""The documents' marked blocks: what lies between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` in README.md or a page of docs/, which the scripts that measure it rewrite
(bench, recovery, chaos32)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def holder(name: str, root: Path = REPO) -> Path | None:
    """The document under ``root`` that holds block ``name``: README.md, or a page of docs/."""
    begin, _ = markers(name)
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if path.is_file() and begin in path.read_text():
            return path
    return None


def rewrite(name: str, text: str, root: Path = REPO) -> Path:
    """``text`` in place of block ``name``'s, the rest of its document untouched; returns the
    document."""
    path = holder(name, root)
    if path is None:
        raise LookupError(f"no document under {root} (README.md, docs/*.md) has a "
                          f"{markers(name)[0]} marker")
    begin, end = markers(name)
    head, rest = path.read_text().split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
    return path
