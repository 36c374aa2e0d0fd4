"""RULER tables: per model and setting, the task average at each length (the RULER paper's table),
and per task; Markdown and CSV. Query-agnostic runs are rows of their own beside query-aware ones. Where
runs recorded their cost, a table of it per setting and length (KV memory, compression overhead, decoding
speed; ``collect.cost_summary``), and the same columns on the CSV's average rows."""
from __future__ import annotations

import csv
from pathlib import Path

from ..ruler.generate import TASKS
from .collect import COST_COLUMNS, COST_FIELDS, COST_NOTE, cost_cells, cost_fields


def _cell(value, note: str = "") -> str:
    return "–" if value is None else f"{value:.2f}{note}"


def write_ruler_tables(runs: list[dict], out: Path) -> list[Path]:
    if not runs:
        return []
    lengths = sorted({int(n) for r in runs for n in r["by_length"]})
    runs = sorted(runs, key=lambda r: (r["model"], r["method"] != "full", r["label"]))
    head = "| model | setting | " + " | ".join(str(n) for n in lengths) + " |"
    rule = "|---|---|" + "---|" * len(lengths)
    md = ["# RULER", "", "Average over the tasks run at each length (13 tasks in RULER's table; a cell says",
          "how many when fewer ran). Scores: RULER's string_match_all / string_match_part.", "", head, rule]
    rows = []
    for r in runs:
        cells = []
        for n in lengths:
            one = r["by_length"].get(str(n))
            note = "" if one is None or one["complete"] else f" ({len(one['tasks'])}/13)"
            cells.append(_cell(None if one is None else one["average"], note))
            rows.append({"model": r["model"], "setting": r["label"], "length": n, "task": "average",
                         "score": None if one is None else one["average"],
                         **cost_fields((r.get("cost_by_length") or {}).get(str(n)))})
        md.append(f"| {r['model']} | {r['label']} | " + " | ".join(cells) + " |")
    md += ["", "## Per task", "", "| model | setting | task | " + " | ".join(str(n) for n in lengths) + " |",
           "|---|---|---|" + "---|" * len(lengths)]
    for r in runs:
        for task in TASKS:
            values = [r["by_length"].get(str(n), {}).get("tasks", {}).get(task) for n in lengths]
            if all(v is None for v in values):
                continue
            md.append(f"| {r['model']} | {r['label']} | {task} | " + " | ".join(_cell(v) for v in values) + " |")
            rows += [{"model": r["model"], "setting": r["label"], "length": n, "task": task, "score": v}
                     for n, v in zip(lengths, values) if v is not None]
    if any(cost for r in runs for cost in (r.get("cost_by_length") or {}).values()):
        md += ["", "## Cost", "", "Per item, the mean over the samples run: " + COST_NOTE, "",
               "| model | setting | length | " + " | ".join(COST_COLUMNS) + " |",
               "|---|---|---|" + "---|" * len(COST_COLUMNS)]
        for r in runs:
            for n in lengths:
                if str(n) in r["by_length"]:
                    cells = cost_cells((r.get("cost_by_length") or {}).get(str(n)))
                    md.append(f"| {r['model']} | {r['label']} | {n} | " + " | ".join(cells) + " |")
    (out / "ruler.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    with open(out / "ruler.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "setting", "length", "task", "score", *COST_FIELDS],
                                restval="")
        writer.writeheader()
        writer.writerows(rows)
    return [out / "ruler.md", out / "ruler.csv"]
