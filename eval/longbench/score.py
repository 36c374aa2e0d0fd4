"""Score a ``pred/`` folder of LongBench predictions (ours or made elsewhere), like official eval.py.

    python -m eval.longbench.score RUN_DIR_OR_PRED_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..jsonl import read_records, write_json_atomic
from .metrics import base_dataset, dataset_score, dataset_score_e


def score_pred_dir(pred_dir: Path) -> tuple[dict, dict]:
    """``(scores, summary)``: ``{dataset: score}`` (LongBench-E: the bucket dict) and row counts."""
    scores, summary = {}, {}
    for path in sorted(Path(pred_dir).glob("*.jsonl")):
        dataset = path.stem
        base_dataset(dataset)
        rows = read_records(path)
        for number, row in enumerate(rows, start=1):
            for field in ("pred", "answers", "length"):
                if field not in row:
                    raise ValueError(f"{path}: record {number} has no field {field!r}")
        scored = [r for r in rows if not r.get("oom")]
        summary[dataset] = {"rows": len(rows), "scored": len(scored), "oom": len(rows) - len(scored)}
        if not scored:
            scores[dataset] = None
        elif dataset.endswith("_e"):
            scores[dataset] = dataset_score_e(dataset, scored)
        else:
            scores[dataset] = dataset_score(dataset, scored)
    return scores, summary


def write_scores(run_dir: Path, pred_dir: Path | None = None) -> dict:
    pred_dir = pred_dir or run_dir / "pred"
    scores, summary = score_pred_dir(pred_dir)
    write_json_atomic(run_dir / "result.json", scores)
    write_json_atomic(run_dir / "summary.json", summary)
    return scores


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m eval.longbench.score RUN_DIR|PRED_DIR", file=sys.stderr)
        return 2
    target = Path(args[0])
    try:
        if not target.is_dir():
            raise ValueError(f"{target}: not a folder")
        pred = target / "pred" if (target / "pred").is_dir() else target
        run_dir = pred.parent if pred.name == "pred" else pred
        scores = write_scores(run_dir, pred)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for dataset, score in scores.items():
        print(f"{dataset}\t{score}")
    print(f"wrote {run_dir / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
