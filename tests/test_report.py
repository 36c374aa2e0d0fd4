"""eval.report: Table 1 beside the published numbers only for the paper's settings, incomplete and
missing cells marked, other runs in their own table, figures written."""
import json

import yaml

from conftest import compose

PAPER_MODEL_CFG = {"name": "lwm-1m", "protocol": "snapkv", "dtype": "float16",
                   "architecture": {"num_attention_heads": 32, "num_key_value_heads": 32}}
SNAPKV_1024 = {"method": "snapkv", "budget": 1024, "window": 32, "kernel": 7, "pooling": "maxpool", "gqa": "mean",
               "tag": "snapkv-b1024"}


def fake_run(root, model_cfg, compressor, scores, summary=None, name=None):
    run = root / "longbench" / model_cfg["name"] / (name or compressor["tag"])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "longbench", "model": model_cfg,
                                                     "compressor": compressor}))
    (run / "result.json").write_text(json.dumps(scores))
    if summary:
        (run / "summary.json").write_text(json.dumps(summary))


def report(tmp_path):
    from eval.report.__main__ import run
    run(compose("report", [f"report.runs={tmp_path / 'runs'}", f"report.out={tmp_path}/out"]))
    return tmp_path / "out"


def rows_of(path, prefix="| lwm-1m"):
    return [l.split(" | ") for l in path.read_text().splitlines() if l.startswith(prefix)]


def test_table1_side_by_side_with_paper_and_missing_cells(tmp_path):
    runs = tmp_path / "runs"
    fake_run(runs, PAPER_MODEL_CFG, SNAPKV_1024, {"narrativeqa": 20.0, "qasper": 23.73})
    fake_run(runs, PAPER_MODEL_CFG, {"method": "full", "budget": None, "tag": "full"}, {"narrativeqa": 18.18})
    out = report(tmp_path)
    lines = rows_of(out / "table1.md")
    assert [l[2] for l in lines] == ["ours", "paper", "ours - paper"] * 2
    snap_ours = next(l for l in lines if l[1] == "snapkv-b1024" and l[2] == "ours")
    assert snap_ours[3:6] == ["20.00", "23.73", "–"]          # missing, never 0
    diff = next(l for l in lines if l[1] == "snapkv-b1024" and l[2] == "ours - paper")
    assert diff[3] == "1.98" and diff[4] == "0.00"            # paper: 18.02, 23.73
    for name in ("table1.csv", "table1.tex", "budget_curve.png", "budget_curve.pdf"):
        assert (out / name).exists()
    assert not (out / "table_ablation.md").exists()


def test_runs_with_other_settings_go_to_the_ablation_table(tmp_path):
    runs = tmp_path / "runs"
    fake_run(runs, {**PAPER_MODEL_CFG, "dtype": "bfloat16"}, SNAPKV_1024, {"narrativeqa": 1.0}, name="bf16")
    fake_run(runs, PAPER_MODEL_CFG, {**SNAPKV_1024, "window": 16, "tag": "w16"}, {"narrativeqa": 2.0})
    fake_run(runs, {**PAPER_MODEL_CFG, "protocol": "longbench"}, SNAPKV_1024, {"narrativeqa": 3.0}, name="lb")
    mistral = {"name": "mistral-7b-instruct-v0.2", "protocol": "snapkv", "dtype": "float16",
               "architecture": {"num_attention_heads": 32, "num_key_value_heads": 8}}
    fake_run(runs, mistral, SNAPKV_1024, {"narrativeqa": 4.0})           # GQA needs gqa=repeat
    fake_run(runs, mistral, {**SNAPKV_1024, "gqa": "repeat", "tag": "rep"}, {"narrativeqa": 5.0})
    out = report(tmp_path)
    beside = rows_of(out / "table1.md", "| mistral")
    assert [(l[1], l[2]) for l in beside] == [("rep", "ours"), ("rep", "paper"), ("rep", "ours - paper")]
    ablation = rows_of(out / "table_ablation.md", "| ")[1:]
    assert sorted(l[3] for l in ablation) == ["1.00", "2.00", "3.00", "4.00"]
    assert not rows_of(out / "table1.md")                        # no lwm run matches the paper


def test_cells_from_fewer_rows_than_the_dataset_are_marked(tmp_path):
    runs = tmp_path / "runs"
    scores = {d: 10.0 for d in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
                                "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum", "passage_count",
                                "passage_retrieval_en", "lcc", "repobench-p")}
    summary = {d: {"rows": 200, "scored": 200, "oom": 0, "dataset_rows": 200} for d in scores}
    summary["narrativeqa"] = {"rows": 153, "scored": 150, "oom": 3, "dataset_rows": 200}
    summary["qasper"] = {"rows": 50, "scored": 50, "oom": 0, "dataset_rows": 200}
    fake_run(runs, PAPER_MODEL_CFG, SNAPKV_1024, scores, summary)
    out = report(tmp_path)
    ours = next(l for l in rows_of(out / "table1.md") if l[2] == "ours")
    assert ours[3] == "10.00 (150/200, 3 OOM)" and ours[4] == "10.00 (50/200)" and ours[5] == "10.00"
    assert ours[-1].startswith("10.00 (incomplete)")
    csv_text = (out / "table1.csv").read_text()
    assert "narrativeqa: 150/200, 3 OOM; qasper: 50/200" in csv_text
