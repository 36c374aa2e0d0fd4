"""README.md and docs/*.md point only at things that exist, and the README stays short.

(a) Every relative markdown link ``[text](target)`` resolves from the file's folder (http(s) and
mailto links and pure ``#anchors`` are not checked; a ``#fragment`` is stripped).
(b) Every backticked repository path (a span starting with ``snapkv/``, ``eval/``, ``conf/``,
``scripts/``, ``tests/``, ``docs/``, ``results/`` or ``.ci/``) exists: a trailing ``:line`` or
``::test_name`` is stripped, a glob must match at least one file, and a span holding ``<`` or ``{``
(a placeholder) is skipped. Paths under the output folders the project's ``.gitignore`` lists
(``/results/runs/``, ...) are what a command writes, not files of the repository: they are skipped.
Fenced code blocks are left out of both checks.
(c) README.md is a front door read to the end: under 300 lines, "## Reproduce the paper" within its
first 200, one line giving ``make test``'s time (the time is updated in one place), and the method count
it names equal to the rows of the generated table in docs/methods.md.
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
MINUTES = re.compile(r"\b(?:\d+(?:-\d+)?|a) minutes?\b")
METHOD_COUNT = re.compile(r"\b(\d+) registered in all\b")
METHOD_TABLE = re.compile(r"<!-- methods:methods -->\n(.*?)\n<!-- /methods:methods -->", re.S)


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


def timed_lines(text: str) -> list[str]:
    """The lines that give ``make test`` a time (code blocks included: the two commands are one)."""
    return [line for line in text.splitlines() if "make test" in line and MINUTES.search(line)]


def table_rows(text: str) -> int:
    """The methods in docs/methods.md's generated table (its lines less the header and the rule)."""
    return len(METHOD_TABLE.search(text).group(1).splitlines()) - 2


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


def test_the_readme_is_read_to_the_end():
    """Under 300 lines, the paper's reproduction within the first 200, and ``make test``'s time given
    once: two lines with two times (25-35 and 22-30 minutes) is what this catches."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move detail into docs/"
    assert "## Reproduce the paper" in lines[:200], "README.md: '## Reproduce the paper' after line 200"
    timed = timed_lines("\n".join(lines))
    assert len(timed) == 1, "README.md should give make test's time on one line:\n" + "\n".join(timed)


def test_the_readme_counts_the_registered_methods():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    count = METHOD_COUNT.search(readme)
    assert count, "README.md names no method count ('N registered in all')"
    rows = table_rows((ROOT / "docs" / "methods.md").read_text(encoding="utf-8"))
    assert int(count.group(1)) == rows, f"README.md says {count.group(1)} methods, docs/methods.md lists {rows}"


def test_the_front_door_checks_catch_what_they_should():
    assert timed_lines("make test  # (about 25 minutes of pytest)\n`make test` runs ruff") == [
        "make test  # (about 25 minutes of pytest)"]
    assert len(timed_lines("make test  # (25-35 minutes)\n`make test`: 22-30 minutes of pytest")) == 2
    assert timed_lines("make demo  # 4-7 minutes\n`make setup`, about a minute\n`make test-fast`") == []
    assert table_rows("<!-- methods:methods -->\n| a |\n|---|\n| x |\n| y |\n<!-- /methods:methods -->") == 2
