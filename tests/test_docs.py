"""README.md and docs/*.md point only at things that exist.

(a) Every relative markdown link ``[text](target)`` resolves from the file's folder (http(s) and
mailto links and pure ``#anchors`` are not checked; a ``#fragment`` is stripped).
(b) Every backticked repository path (a span starting with ``snapkv/``, ``eval/``, ``conf/``,
``scripts/``, ``tests/``, ``docs/``, ``results/`` or ``.ci/``) exists: a trailing ``:line`` or
``::test_name`` is stripped, a glob must match at least one file, and a span holding ``<`` or ``{``
(a placeholder) is skipped. Paths under the output folders the project's ``.gitignore`` lists
(``/results/runs/``, ...) are what a command writes, not files of the repository: they are skipped.
Fenced code blocks are left out of both checks.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("snapkv/", "eval/", "conf/", "scripts/", "tests/", "docs/", "results/", ".ci/")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINE_SUFFIX = re.compile(r":\d+(?:-\d+)?$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(path: Path) -> str:
    """The file's text without its fenced code blocks."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def output_folders() -> tuple[str, ...]:
    """Folders the repository ignores because commands write them (``/results/runs/`` -> ``results/runs/``)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(line.strip().lstrip("/") for line in lines if line.strip().startswith("/results/"))


def missing_links(path: Path) -> list[str]:
    missing = []
    for target in LINK.findall(prose(path)):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        relative = target.split("#", 1)[0]
        if relative and not (path.parent / relative).exists():
            missing.append(target)
    return missing


def repository_path(span: str) -> str | None:
    """The repository path a backticked span names, or None when it names none to check."""
    span = span.strip()
    if not span.startswith(PREFIXES) or "<" in span or "{" in span:
        return None
    token = span.split()[0]  # `scripts/local_slurm.sh stop`: the file is the first word
    token = token.split("::", 1)[0]
    return LINE_SUFFIX.sub("", token).rstrip(".,;")


def exists(token: str) -> bool:
    if any(ch in token for ch in "*?["):
        return any(ROOT.glob(token.rstrip("/")))
    return (ROOT / token).exists()


def missing_paths(path: Path) -> list[str]:
    outputs = output_folders()
    missing = []
    for span in CODE.findall(prose(path)):
        token = repository_path(span)
        if token is None or token.startswith(outputs) or (token + "/").startswith(outputs):
            continue
        if not exists(token):
            missing.append(token)
    return missing


def report(found: dict[Path, list[str]]) -> str:
    return "\n".join(f"{path.relative_to(ROOT)}: {item}" for path, items in found.items() for item in items)


def test_the_docs_are_there():
    names = {path.name for path in doc_files() if path.exists()}
    assert {"README.md", "architecture.md", "extending.md", "runs.md"} <= names


def test_every_relative_link_exists():
    found = {path: sorted(set(missing_links(path))) for path in doc_files()}
    found = {path: items for path, items in found.items() if items}
    assert not found, "links to files that do not exist:\n" + report(found)


def test_every_backticked_repository_path_exists():
    found = {path: sorted(set(missing_paths(path))) for path in doc_files()}
    found = {path: items for path, items in found.items() if items}
    assert not found, "backticked paths that are not in the repository:\n" + report(found)


def test_the_checks_catch_what_they_should():
    assert repository_path("tests/test_select.py::test_official") == "tests/test_select.py"
    assert repository_path("snapkv/hooks.py:290") == "snapkv/hooks.py"
    assert repository_path("scripts/local_slurm.sh stop") == "scripts/local_slurm.sh"
    assert repository_path("results/runs/<task>/<model>") is None
    assert repository_path("python -m eval.bench") is None
    assert exists("conf/model/*.yaml") and not exists("conf/model/*.nothing")
    assert not exists("snapkv/no_such_module.py")
    assert "results/runs/" in output_folders()
    assert FENCE.sub("", "a\n```bash\n`snapkv/x.py` [l](y.md)\n```\nb") == "a\n\nb"
