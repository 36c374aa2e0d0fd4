"""The docs' method tables, generated from the method registry (each method's card: ``Method.paper``,
``reference``, ``budget_meaning``, ``deviations``). ``python scripts/write_compressor_configs.py`` writes
them between the ``<!-- methods:NAME -->`` markers of docs/methods.md, docs/library.md and docs/leaderboard.md;
a test keeps the files equal to what this module generates."""
from __future__ import annotations

import re
from pathlib import Path

import snapkv

ROOT = Path(__file__).resolve().parent.parent
# table name -> the file it stands in
FILES = {"methods": ROOT / "docs" / "methods.md", "library": ROOT / "docs" / "library.md",
         "leaderboard": ROOT / "docs" / "leaderboard.md", "families": ROOT / "docs" / "library.md"}
EQUAL = "kept positions and tokens equal (tested)"


def _ordered() -> list:
    """Full KV first (the baseline every table starts from), then the methods by name."""
    classes = sorted(snapkv.METHODS.values(), key=lambda cls: cls.method)
    return sorted(classes, key=lambda cls: cls().compresses)


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "—"


def methods_table() -> str:
    """One line a method: its option, class, paper and the code it reproduces (docs/methods.md)."""
    rows = ["| method | `compressor=` | class | paper | reproduces |", "|---|---|---|---|---|"]
    for cls in _ordered():
        rows.append(f"| {cls.display_name or cls.method} | `{cls.method}` | `snapkv.{cls.__name__}` | "
                    f"{_cell(cls.paper)} | {_cell(cls.reference)} |")
    return "\n".join(rows)


def library_table() -> str:
    rows = ["| method (`compressor=`) | class | paper | reference code reproduced | budget | known deviations |",
            "|---|---|---|---|---|---|"]
    for cls in _ordered():
        rows.append(f"| `{cls.method}` | `snapkv.{cls.__name__}` | {_cell(cls.paper)} | {_cell(cls.reference)} | "
                    f"{_cell(cls.budget_meaning)} | {_cell(cls.deviations)} |")
    return "\n".join(rows)


def leaderboard_table() -> str:
    """Every kvpress registry entry a method declares: its board (none for an entry that declares no board:
    ThinK's, whose size is not the board's ratio), its option here, its parity with kvpress."""
    from snapkv.registry import PLACEMENTS, kvpress_entries
    rows = ["| kvpress registry entry | board | here | checked against kvpress |", "|---|---|---|---|"]
    boards = [(placement, kvpress_entries(placement)) for placement in PLACEMENTS]
    on_a_board = {option for _, entries in boards for option in entries}
    boards.append((None, {option: entry for option, entry in kvpress_entries().items() if option not in on_a_board}))
    for placement, entries in boards:
        for option, (method, press, fields) in entries.items():
            declared = next(entry for cls in snapkv.METHODS.values() for name, entry in cls.kvpress_entries.items()
                            if name == press and entry.get("method", cls.method) == method)
            setting = ", ".join(f"{k}={v}" for k, v in fields.items())
            here = f"`compressor={option}`" + (f" ({setting})" if setting else "")
            parity = "—" if not snapkv.METHODS[method]().compresses else declared.get("parity", EQUAL)
            board = {"agnostic": "query-agnostic", "aware": "query-aware", None: "—"}[placement]
            rows.append(f"| `{press}` | {board} | {here} | {_cell(parity)} |")
    return "\n".join(rows)


def families_table() -> str:
    """One line a model family (``snapkv.families``): what the compressor reads that Llama does not have, and how it
    stands (read exactly, pinned by tests/test_families.py, or refused in one line and why)."""
    from snapkv.families import FAMILIES
    rows = ["| family (`model_type`) | e.g. | what it needed | status |", "|---|---|---|---|"]
    for family in FAMILIES:
        status = f"refused: {family.refused}" if family.refused else (
            "exact: kept positions, greedy tokens, rotation (tested)" + (f"; {family.limits}" if family.limits else ""))
        rows.append(f"| {family.name} (`{family.model_type}`) | `{family.example}` | {_cell(family.differs)} | "
                    f"{status} |")
    return "\n".join(rows)


TABLES = {"methods": methods_table, "library": library_table, "leaderboard": leaderboard_table,
          "families": families_table}


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- methods:{name} -->\n)(.*?)(\n<!-- /methods:{name} -->)", re.S)


def with_table(text: str, name: str) -> str:
    """``text`` with its ``name`` table replaced by the generated one."""
    pattern = _block(name)
    if not pattern.search(text):
        raise ValueError(f"no <!-- methods:{name} --> ... <!-- /methods:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + TABLES[name]() + m.group(3), text)


def write_tables() -> list[Path]:
    written = []
    for name, path in FILES.items():
        path.write_text(with_table(path.read_text(encoding="utf-8"), name), encoding="utf-8")
        written.append(path)
    return written
