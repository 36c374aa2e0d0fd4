"""eval.report: Table 1 beside the published numbers, missing cells as missing, figures written."""
import json

import yaml

from conftest import compose


def fake_run(root, model, compressor, scores):
    run = root / "longbench" / model / compressor["tag"]
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "longbench", "model": {"name": model},
                                                     "compressor": compressor}))
    (run / "result.json").write_text(json.dumps(scores))


def test_table1_side_by_side_with_paper_and_missing_cells(tmp_path):
    from eval.report.__main__ import run
    runs = tmp_path / "runs"
    fake_run(runs, "lwm-1m", {"method": "snapkv", "budget": 1024, "pooling": "maxpool", "tag": "snapkv-b1024"},
             {"narrativeqa": 20.0, "qasper": 23.73})
    fake_run(runs, "lwm-1m", {"method": "full", "budget": None, "tag": "full"}, {"narrativeqa": 18.18})
    run(compose("report", [f"report.runs={runs}", f"report.out={tmp_path}/out"]))
    md = (tmp_path / "out" / "table1.md").read_text()
    lines = [l for l in md.splitlines() if l.startswith("| lwm-1m")]
    assert [l.split(" | ")[2] for l in lines] == ["ours", "paper", "ours - paper"] * 2
    snap_ours = next(l for l in lines if "snapkv-b1024 | ours |" in l).split(" | ")
    assert snap_ours[3:6] == ["20.00", "23.73", "–"]          # missing, never 0
    diff = next(l for l in lines if "snapkv-b1024 | ours - paper" in l).split(" | ")
    assert diff[3] == "1.98" and diff[4] == "0.00"            # paper: 18.02, 23.73
    for name in ("table1.csv", "table1.tex", "budget_curve.png", "budget_curve.pdf"):
        assert (tmp_path / "out" / name).exists()
