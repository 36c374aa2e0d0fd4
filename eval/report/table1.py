"""LongBench Table 1 in the paper's layout, our runs beside the published numbers."""
from __future__ import annotations

import csv
from pathlib import Path

from ..longbench.data import PAPER_DATASETS

PAPER_TSV = Path(__file__).resolve().parent.parent / "data" / "snapkv_paper_table1.tsv"
PAPER_MODEL = {"lwm-1m": "LWM-Text-Chat-1M", "longchat-7b-32k": "LongChat-7b-v1.5-32k",
               "mistral-7b-instruct-v0.2": "Mistral-7B-Instruct-v0.2",
               "mixtral-8x7b-instruct-v0.1": "Mixtral-8x7B-Instruct-v0.1"}
SHORT = {"narrativeqa": "NrtvQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "hotpotqa": "HotpotQA",
         "2wikimqa": "2WikiMQA", "musique": "Musique", "gov_report": "GovReport", "qmsum": "QMSum",
         "multi_news": "MultiNews", "trec": "TREC", "triviaqa": "TriviaQA", "samsum": "SAMSum",
         "passage_count": "PCount", "passage_retrieval_en": "PRe", "lcc": "Lcc", "repobench-p": "RB-P"}


def paper_rows() -> dict[tuple[str, str], dict]:
    lines = [l for l in PAPER_TSV.read_text(encoding="utf-8").splitlines() if l and not l.startswith("#")]
    reader = csv.DictReader(lines, delimiter="\t")
    return {(r["model"], r["setting"]): {d: float(r[d]) for d in PAPER_DATASETS} for r in reader}


def paper_setting(method: str, budget) -> str | None:
    if method == "full":
        return "AllKV"
    if method == "snapkv":
        return f"SnapKV{budget}"
    if method == "h2o":
        return f"H2O{budget}"
    return None


def average(scores: dict) -> float | None:
    values = [scores.get(d) for d in PAPER_DATASETS]
    return round(sum(values) / len(values), 2) if all(isinstance(v, (int, float)) for v in values) else None


def table_rows(runs: list[dict]) -> list[dict]:
    """One row per (model, setting) of ours, and the matching published row when there is one."""
    published = paper_rows()
    rows = []
    order = {"full": 0, "snapkv": 1, "pyramidkv": 2, "h2o": 3, "streamingllm": 4, "random": 5}
    for run in sorted(runs, key=lambda r: (r["model"], order.get(r["method"], 9), r["budget"] or 0, r["tag"])):
        ours = {d: run["scores"].get(d) for d in PAPER_DATASETS}
        row = {"model": run["model"], "setting": run["tag"], "source": "ours", **ours, "avg16": average(ours)}
        rows.append(row)
        key = (PAPER_MODEL.get(run["model"]), paper_setting(run["method"], run["budget"]))
        if key in published:
            paper = published[key]
            rows.append({"model": run["model"], "setting": run["tag"], "source": "paper", **paper,
                         "avg16": average(paper)})
            rows.append({"model": run["model"], "setting": run["tag"], "source": "ours - paper",
                         **{d: (None if ours[d] is None else round(ours[d] - paper[d], 2)) for d in PAPER_DATASETS},
                         "avg16": None if row["avg16"] is None else round(row["avg16"] - average(paper), 2)})
    return rows


def _cell(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def write_table1(rows: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    cols = list(PAPER_DATASETS) + ["avg16"]
    md = ["| model | setting | source | " + " | ".join(SHORT.get(c, c) for c in cols) + " |",
          "|---|---|---|" + "---|" * len(cols)]
    tex = ["\\begin{tabular}{lll" + "r" * len(cols) + "}", "\\toprule",
           "Model & Setting & Source & " + " & ".join(SHORT.get(c, c) for c in cols) + " \\\\", "\\midrule"]
    for r in rows:
        md.append(f"| {r['model']} | {r['setting']} | {r['source']} | " + " | ".join(_cell(r[c]) for c in cols) + " |")
        tex.append(" & ".join([r["model"], r["setting"].replace("_", "\\_"), r["source"]]
                              + [_cell(r[c]).replace("–", "--") for c in cols]) + " \\\\")
    tex += ["\\bottomrule", "\\end{tabular}"]
    paths = [out / "table1.md", out / "table1.csv", out / "table1.tex"]
    paths[0].write_text("\n".join(md) + "\n\nMissing cells (–) were not run; they are never counted as 0.\n",
                        encoding="utf-8")
    with paths[1].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "setting", "source", *cols])
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    paths[2].write_text("\n".join(tex) + "\n", encoding="utf-8")
    return paths
