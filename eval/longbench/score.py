"""Score LongBench predictions (ours or made elsewhere) like official ``eval.py``; reads, never writes them.

    python -m eval.longbench.score RUN_DIR        # pred/ and pred_e/ of one of our runs
    python -m eval.longbench.score PRED_DIR [--e] # a folder of <dataset>.jsonl (official layout)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..jsonl import read_records, write_json_atomic
from .metrics import base_dataset, dataset_score, dataset_score_e
from snapkv.errors import InputError


def score_pred_dir(pred_dir: Path, longbench_e: bool = False) -> tuple[dict, dict]:
    """``(scores, summary)`` of one folder of ``<dataset>.jsonl``: ``{dataset: score}`` (LongBench-E,
    where files are named without ``_e`` as official ``eval.py --e`` reads them: ``{dataset_e:
    buckets}``) and row counts. Rows that ran out of memory are counted, not scored."""
    scores, summary = {}, {}
    for path in sorted(Path(pred_dir).glob("*.jsonl")):
        dataset = path.stem + ("_e" if longbench_e and not path.stem.endswith("_e") else "")
        base_dataset(dataset)
        rows = read_records(path)
        for number, row in enumerate(rows, start=1):
            for field in ("pred", "answers", "length"):
                if field not in row:
                    raise InputError(f"{path}: record {number} has no field {field!r}")
        scored = [r for r in rows if not r.get("oom")]
        summary[dataset] = {"rows": len(rows), "scored": len(scored), "oom": len(rows) - len(scored)}
        if not scored:
            scores[dataset] = None
        elif dataset.endswith("_e"):
            scores[dataset] = dataset_score_e(dataset, scored)
        else:
            scores[dataset] = dataset_score(dataset, scored)
    return scores, summary


def score_run(run_dir: Path) -> tuple[dict, dict]:
    """Both layouts of a run folder; the summary also says how many rows each dataset holds."""
    scores, summary = score_pred_dir(run_dir / "pred")
    e_scores, e_summary = score_pred_dir(run_dir / "pred_e", longbench_e=True)
    scores.update(e_scores)
    summary.update(e_summary)
    info = run_dir / "datasets.json"
    totals = json.loads(info.read_text(encoding="utf-8")) if info.exists() else {}
    for dataset, counts in summary.items():
        if dataset in totals:
            counts["dataset_rows"] = totals[dataset]["rows"]
    return scores, summary


def write_scores(run_dir: Path) -> dict:
    scores, summary = score_run(run_dir)
    write_json_atomic(run_dir / "result.json", scores)
    write_json_atomic(run_dir / "summary.json", summary)
    return scores


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    longbench_e = "--e" in args
    args = [a for a in args if a != "--e"]
    if len(args) != 1:
        print("usage: python -m eval.longbench.score RUN_DIR | PRED_DIR [--e]", file=sys.stderr)
        return 2
    target = Path(args[0])
    try:
        if not target.is_dir():
            raise InputError(f"{target}: not a folder")
        if (target / "pred").is_dir() or (target / "pred_e").is_dir():
            scores, summary = score_run(target)
        else:
            scores, summary = score_pred_dir(target, longbench_e or target.parent.name == "pred_e")
        write_json_atomic(target / "result.json", scores)
        write_json_atomic(target / "summary.json", summary)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for dataset, score in scores.items():
        print(f"{dataset}\t{score}")
    print(f"wrote {target / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
