"""LongBench Table 1 in the paper's layout: runs made with the paper's settings beside the published
numbers, every other run in an ablation table of its own. A cell computed from fewer rows than the
dataset holds says so (``41.20 (150/200, 3 OOM)``); a missing cell is "–", never 0. Where runs recorded
their cost, a table gains its columns (KV memory per item, compression overhead, decoding ms per token;
``collect.cost_summary``), blank on rows without one; the CSV always has them."""
from __future__ import annotations

import csv
from pathlib import Path

from ..longbench.data import PAPER_DATASETS
from .collect import COST_COLUMNS, COST_FIELDS, COST_NOTE, cost_cells, cost_fields

PAPER_TSV = Path(__file__).resolve().parent.parent / "data" / "snapkv_paper_table1.tsv"
PAPER_MODEL = {"lwm-1m": "LWM-Text-Chat-1M", "longchat-7b-32k": "LongChat-7b-v1.5-32k",
               "mistral-7b-instruct-v0.2": "Mistral-7B-Instruct-v0.2",
               "mixtral-8x7b-instruct-v0.1": "Mixtral-8x7B-Instruct-v0.1"}
SHORT = {"narrativeqa": "NrtvQA", "qasper": "Qasper", "multifieldqa_en": "MF-en", "hotpotqa": "HotpotQA",
         "2wikimqa": "2WikiMQA", "musique": "Musique", "gov_report": "GovReport", "qmsum": "QMSum",
         "multi_news": "MultiNews", "trec": "TREC", "triviaqa": "TriviaQA", "samsum": "SAMSum",
         "passage_count": "PCount", "passage_retrieval_en": "PRe", "lcc": "Lcc", "repobench-p": "RB-P"}
# The settings of the paper's rows (pred_snap.py and SnapKV's LongBench configs).
PAPER_SNAPKV = {"window": 32, "kernel": 7, "pooling": "maxpool"}
PAPER_BUDGETS = {"snapkv": (1024, 2048, 4096), "h2o": (4096,)}


def paper_rows() -> dict[tuple[str, str], dict]:
    lines = [l for l in PAPER_TSV.read_text(encoding="utf-8").splitlines() if l and not l.startswith("#")]
    reader = csv.DictReader(lines, delimiter="\t")
    return {(r["model"], r["setting"]): {d: float(r[d]) for d in PAPER_DATASETS} for r in reader}


def paper_setting(run: dict) -> tuple[str, str] | None:
    """The published row a run reproduces, or None when its settings differ from the paper's."""
    model, comp, model_cfg = run["model"], run["compressor"], run.get("model_cfg", {})
    if model not in PAPER_MODEL or model_cfg.get("protocol") != "snapkv" or model_cfg.get("dtype") != "float16":
        return None
    if not run.get("query_aware", True):  # the paper compressed the whole prompt, question included
        return None
    method, budget = run["method"], run["budget"]
    if method == "full":
        return PAPER_MODEL[model], "AllKV"
    if budget not in PAPER_BUDGETS.get(method, ()):
        return None
    if method == "snapkv":
        if any(comp.get(k) != v for k, v in PAPER_SNAPKV.items()):
            return None
        arch = model_cfg.get("architecture") or {}
        mha = arch.get("num_key_value_heads") == arch.get("num_attention_heads") is not None
        if comp.get("gqa") != "repeat" and not mha:  # the official code selects per query head
            return None
        return PAPER_MODEL[model], f"SnapKV{budget}"
    return PAPER_MODEL[model], f"H2O{budget}"


def average(scores: dict) -> float | None:
    values = [scores.get(d) for d in PAPER_DATASETS]
    return round(sum(values) / len(values), 2) if all(isinstance(v, (int, float)) for v in values) else None


def incomplete(run: dict) -> dict:
    """``{dataset: "150/200, 3 OOM"}`` for every dataset scored on fewer rows than it holds."""
    notes = {}
    for dataset, counts in run.get("summary", {}).items():
        total = counts.get("dataset_rows", counts["rows"])
        if counts["scored"] < total:
            oom = f", {counts['oom']} OOM" if counts["oom"] else ""
            notes[dataset] = f"{counts['scored']}/{total}{oom}"
    return notes


def _ours(run: dict, order) -> dict:
    ours = {d: run["scores"].get(d) for d in PAPER_DATASETS}
    return {"model": run["model"], "setting": run["label"], "tag": run["tag"], "source": "ours", **ours,
            "avg16": average(ours), "cost": run.get("cost"),
            "incomplete": {d: n for d, n in incomplete(run).items() if d in PAPER_DATASETS}}


def table_rows(runs: list[dict], order) -> tuple[list[dict], list[dict]]:
    """``(paper_rows, ablation_rows)``: runs with the paper's settings, each followed by the
    published row and the difference; every other run on its own."""
    published = paper_rows()
    beside, ablation = [], []
    rank = {m: i for i, m in enumerate(order)}
    for run in sorted(runs, key=lambda r: (r["model"], rank.get(r["method"], len(rank)), r["budget"] or 0, r["tag"])):
        row = _ours(run, order)
        key = paper_setting(run)
        if key not in published:
            ablation.append(row)
            continue
        paper = published[key]
        beside.append(row)
        beside.append({"model": run["model"], "setting": run["label"], "tag": run["tag"], "source": "paper", **paper,
                       "avg16": average(paper), "incomplete": {}, "cost": None})
        beside.append({"model": run["model"], "setting": run["label"], "tag": run["tag"], "source": "ours - paper",
                       **{d: (None if row[d] is None else round(row[d] - paper[d], 2)) for d in PAPER_DATASETS},
                       "avg16": None if row["avg16"] is None else round(row["avg16"] - average(paper), 2),
                       "incomplete": row["incomplete"], "cost": None})
    return beside, ablation


def _cell(row: dict, column: str) -> str:
    value = row[column]
    if value is None:
        return "–"
    note = row["incomplete"].get(column)
    if column == "avg16" and row["incomplete"]:
        note = "incomplete"
    return f"{value:.2f}" + (f" ({note})" if note else "")


def _tex(text: str) -> str:
    return text.replace("_", "\\_").replace("–", "--").replace("%", "\\%")


def write_table(rows: list[dict], out: Path, name: str, caption: str, columns=None, short=None) -> list[Path]:
    """Markdown, CSV and LaTeX (booktabs, one block per model as in the paper); short run labels in
    the table, every label's full settings (its run tag) listed under it."""
    out.mkdir(parents=True, exist_ok=True)
    cols = list(columns or [*PAPER_DATASETS, "avg16"])
    short = short or SHORT
    extra = list(COST_COLUMNS) if any(r.get("cost") for r in rows) else []
    heads = [short.get(c, c) for c in cols] + extra
    md = [f"{caption}\n", "| model | setting | source | " + " | ".join(heads) + " |",
          "|---|---|---|" + "---|" * len(heads)]
    tex = ["\\begin{tabular}{ll" + "r" * len(heads) + "}", "\\toprule",
           "Setting & Source & " + " & ".join(_tex(h) for h in heads) + " \\\\"]
    model = None
    for r in rows:
        cells = [_cell(r, c) for c in cols] + (cost_cells(r.get("cost")) if extra else [])
        md.append(f"| {r['model']} | {r['setting']} | {r['source']} | " + " | ".join(cells) + " |")
        if r["model"] != model:
            model = r["model"]
            title = f"\\multicolumn{{{len(heads) + 2}}}{{l}}{{\\textit{{{_tex(model)}}}}} \\\\"
            tex += ["\\midrule", title, "\\midrule"]
        tex.append(" & ".join([_tex(r["setting"]), r["source"]] + [_tex(c) for c in cells]) + " \\\\")
    tex += ["\\bottomrule", "\\end{tabular}"]
    settings = sorted({(r["setting"], r["tag"]) for r in rows})
    md += ["", "Settings: " + "; ".join(f"{label} = `{tag}`" for label, tag in settings) + ".",
           "", "Missing cells (–) were not run; they are never counted as 0. A cell followed by (scored/rows, "
           "OOM) was computed from fewer rows than the dataset holds."]
    if extra:
        md += ["", "Cost per item (mean over the rows run): " + COST_NOTE]
    paths = [out / f"{name}.md", out / f"{name}.csv", out / f"{name}.tex"]
    paths[0].write_text("\n".join(md) + "\n", encoding="utf-8")
    with paths[1].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "setting", "tag", "source", *cols, "incomplete",
                                               *COST_FIELDS])
        writer.writeheader()
        for r in rows:
            fields = ["model", "setting", "tag", "source", *cols]
            writer.writerow({**{k: ("" if r.get(k) is None else r[k]) for k in fields},
                             "incomplete": "; ".join(f"{d}: {n}" for d, n in r["incomplete"].items()),
                             **cost_fields(r.get("cost"))})
    paths[2].write_text("\n".join(tex) + "\n% settings: " + "; ".join(f"{l} = {t}" for l, t in settings) + "\n",
                        encoding="utf-8")
    return paths


# The camera-ready Table 2 settings: (window, kernel, pooling) at budget 1024.
HYPERPARAMS = ((32, 7, "maxpool"), (16, 7, "maxpool"), (64, 7, "maxpool"), (32, 5, "maxpool"), (32, 9, "maxpool"),
               (32, 1, "none"))


def hyperparam_rows(runs: list[dict]) -> list[dict]:
    """SnapKV budget-1024 runs at the paper's six (window, kernel) settings, per model, in its order."""
    rows = []
    for model in sorted({r["model"] for r in runs}):
        found = {}
        for r in runs:
            c = r["compressor"]
            if r["model"] == model and r["method"] == "snapkv" and r["budget"] == 1024:
                setting = (c.get("window"), c.get("kernel") if c.get("pooling") != "none" else 1,
                           c.get("pooling") if c.get("kernel") != 1 else "none")
                if setting in HYPERPARAMS:
                    found[setting] = r
        if len(found) < 2:
            continue
        for setting in HYPERPARAMS:
            if setting in found:
                row = _ours(found[setting], ())
                no_pooling = " (no pooling)" if setting[1] == 1 else ""
                row["setting"] = f"window {setting[0]}, kernel {setting[1]}{no_pooling}"
                rows.append(row)
    return rows


def write_tables(runs: list[dict], out: Path, order) -> list[Path]:
    beside, ablation = table_rows(runs, order)
    paths = []
    if beside:
        paths += write_table(beside, out, "table1", "SnapKV Table 1: runs with the paper's settings (pred_snap.py "
                             "protocol, float16, window 32, kernel 7, max pooling) beside the published numbers.")
    if ablation:
        paths += write_table(ablation, out, "table_ablation", "LongBench runs whose settings differ from the "
                             "paper's rows (other models, budgets, windows, kernels, protocols or dtypes).")
    hyper = hyperparam_rows(runs)
    if hyper:
        paths += write_table(hyper, out, "table_hyperparams", "SnapKV hyperparameters at budget 1024 (the layout "
                             "of the camera-ready Table 2): observation window and pooling kernel.")
    return paths
