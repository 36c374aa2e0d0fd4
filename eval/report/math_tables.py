"""AIME25 / MATH-500 tables: per dataset, model and setting, kvpress's accuracy and math-verify's side by
side (``eval.math.score``), with what each setting cost; Markdown and CSV."""
from __future__ import annotations

import csv
from pathlib import Path

from ..math.score import MATH_VERIFY_MISSING
from .collect import COST_COLUMNS, COST_FIELDS, COST_NOTE, cost_cells, cost_fields


def _percent(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def write_math_tables(runs: list[dict], out: Path) -> list[Path]:
    if not runs:
        return []
    runs = sorted(runs, key=lambda r: (r["scores"]["dataset"], r["model"], r["method"] != "full", r["label"]))
    head = ("dataset", "model", "setting", "items", "kvpress accuracy %", "answered", "math-verify accuracy %",
            "cut at max_new_tokens", "oom", *COST_COLUMNS)
    md = ["# AIME25 and MATH-500", "",
          "kvpress accuracy: kvpress's own scorer (the boxed text as a string: the last `boxed{` for AIME25, the",
          "first for MATH-500, up to the first `}`). math-verify accuracy: mathematical equivalence by",
          "Hugging Face's math-verify. Items that ran out of memory are counted, not scored; cut: answers that",
          "reached max_new_tokens. Cost: per item, " + COST_NOTE, "",
          "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    rows = []
    for r in runs:
        s = r["scores"]
        verified = s.get("math_verify")
        verified_accuracy = None if verified is None else verified["accuracy"]
        cells = [s["dataset"], r["model"], r["label"], str(s["scored"]), _percent(s["kvpress"]["accuracy"]),
                 str(s["kvpress"]["answered"]), _percent(verified_accuracy), str(s["hit_max_new_tokens"]),
                 str(s["oom"]), *cost_cells(r.get("cost"))]
        md.append("| " + " | ".join(cells) + " |")
        rows.append({"dataset": s["dataset"], "model": r["model"], "setting": r["label"], "items": s["scored"],
                     "kvpress_accuracy": s["kvpress"]["accuracy"], "answered": s["kvpress"]["answered"],
                     "math_verify_accuracy": verified_accuracy, "hit_max_new_tokens": s["hit_max_new_tokens"],
                     "oom": s["oom"], **cost_fields(r.get("cost"))})
    if any(r["scores"].get("math_verify") is None for r in runs):
        md += ["", f"–: {MATH_VERIFY_MISSING} when the run was scored (rerun its command, or "
               "`python -m eval.math.score RUN_DIR`, once it is installed)."]
    (out / "math.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    with open(out / "math.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["dataset", "model", "setting", "items", "kvpress_accuracy", "answered",
                                               "math_verify_accuracy", "hit_max_new_tokens", "oom", *COST_FIELDS],
                                restval="")
        writer.writeheader()
        writer.writerows(rows)
    return [out / "math.md", out / "math.csv"]
