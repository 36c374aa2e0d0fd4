"""eval.report: Table 1 beside the published numbers only for the paper's settings, incomplete and
missing cells marked, other runs in their own table, figures written."""
import json

import yaml

from conftest import compose

PAPER_MODEL_CFG = {"name": "lwm-1m", "protocol": "snapkv", "dtype": "float16",
                   "architecture": {"num_attention_heads": 32, "num_key_value_heads": 32}}
SNAPKV_1024 = {"method": "snapkv", "budget": 1024, "window": 32, "kernel": 7, "pooling": "maxpool", "gqa": "mean",
               "tag": "snapkv-b1024"}


def fake_run(root, model_cfg, compressor, scores, summary=None, name=None, query_aware=True):
    run = root / "longbench" / model_cfg["name"] / (name or compressor["tag"])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "longbench", "model": model_cfg,
                                                     "compressor": compressor, "query_aware": query_aware}))
    (run / "result.json").write_text(json.dumps(scores))
    if summary:
        (run / "summary.json").write_text(json.dumps(summary))


def fake_ruler_run(runs, tag, compressor, average, query_aware=True, complete=False):
    """A RULER run of model ``m`` at 4096 tokens whose only task, vt, scored ``average``."""
    run = runs / "ruler" / "m" / tag
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "ruler", "model": {"name": "m"},
                                                     "compressor": compressor, "query_aware": query_aware}))
    (run / "scores.json").write_text(json.dumps({"4096": {"tasks": {"vt": average}, "average": average,
                                                          "complete": complete, "counts": {}}}))


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
    snap_ours = next(l for l in lines if l[1] == "SnapKV 1024" and l[2] == "ours")
    assert snap_ours[3:6] == ["20.00", "23.73", "–"]          # missing, never 0
    diff = next(l for l in lines if l[1] == "SnapKV 1024" and l[2] == "ours - paper")
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
    label = "SnapKV 1024 (gqa repeat)"
    assert [(l[1], l[2]) for l in beside] == [(label, "ours"), (label, "paper"), (label, "ours - paper")]
    assert f"{label} = `rep`" in (out / "table1.md").read_text()         # short label, full settings below
    ablation = rows_of(out / "table_ablation.md", "| ")[1:]
    assert sorted(l[3] for l in ablation) == ["1.00", "2.00", "3.00", "4.00"]
    assert not rows_of(out / "table1.md")                        # no lwm run matches the paper


def test_query_agnostic_runs_sit_beside_query_aware_ones_outside_table1(tmp_path):
    runs = tmp_path / "runs"
    fake_run(runs, PAPER_MODEL_CFG, SNAPKV_1024, {"narrativeqa": 20.0})
    fake_run(runs, PAPER_MODEL_CFG, SNAPKV_1024, {"narrativeqa": 7.0}, name="agnostic", query_aware=False)
    fake_run(runs, PAPER_MODEL_CFG, {**SNAPKV_1024, "budget": None, "ratio": 0.5, "tag": "r0.5"},
             {"narrativeqa": 9.0})
    out = report(tmp_path)
    assert [l[1] for l in rows_of(out / "table1.md") if l[2] == "ours"] == ["SnapKV 1024"]
    ablation = {l[1]: l[3] for l in rows_of(out / "table_ablation.md")}
    assert ablation == {"SnapKV 1024 · query-agnostic": "7.00", "SnapKV ratio 0.5": "9.00"}
    assert (out / "budget_curve.png").exists()


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


def test_hyperparameter_table_in_the_paper_layout(tmp_path):
    runs = tmp_path / "runs"
    for window, kernel, pooling in ((32, 7, "maxpool"), (16, 7, "maxpool"), (32, 1, "none"), (32, 3, "maxpool")):
        fake_run(runs, {"name": "mistral", "protocol": "snapkv", "dtype": "float16"},
                 {**SNAPKV_1024, "window": window, "kernel": kernel, "pooling": pooling, "tag": f"w{window}k{kernel}"},
                 {"narrativeqa": float(window + kernel)})
    out = report(tmp_path)
    rows = rows_of(out / "table_hyperparams.md", "| mistral")
    assert [(r[1], r[3]) for r in rows] == [("window 32, kernel 7", "39.00"), ("window 16, kernel 7", "23.00"),
                                            ("window 32, kernel 1 (no pooling)", "33.00")]
    tex = (out / "table_hyperparams.tex").read_text()
    assert "\\toprule" in tex and "\\multicolumn{19}{l}{\\textit{mistral}}" in tex


def test_report_is_byte_identical_on_the_same_runs(tmp_path):
    import hashlib
    runs = tmp_path / "runs"
    fake_run(runs, PAPER_MODEL_CFG, SNAPKV_1024, {"narrativeqa": 20.0, "qasper": 23.73})
    fake_run(runs, PAPER_MODEL_CFG, {"method": "full", "budget": None, "tag": "full"}, {"narrativeqa": 18.18})
    needle = runs / "needle" / "m" / "full"
    needle.mkdir(parents=True)
    (needle / "config.yaml").write_text(yaml.safe_dump({"task": "needle", "model": {"name": "m"},
                                                       "compressor": {"method": "full", "tag": "full"}}))
    (needle / "needle.jsonl").write_text("".join(json.dumps({"context_length": n, "depth_percent": d, "score": 0.5})
                                                 + "\n" for n in (100, 200) for d in (0, 50)))
    digests = []
    for out in ("a", "b"):
        from eval.report.__main__ import run
        run(compose("report", [f"report.runs={runs}", f"report.out={tmp_path / out}"]))
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((tmp_path / out).rglob("*"))
                        if p.is_file()})
    assert digests[0] == digests[1] and any(name.endswith(".pdf") for name in digests[0])


def test_ruler_runs_get_their_tables_and_budget_curve(tmp_path):
    runs = tmp_path / "runs"
    for tag, compressor, query_aware, avg in [("full", {"method": "full", "budget": None}, True, 90.0),
                                              ("snap", SNAPKV_1024, True, 80.0), ("snap-qa", SNAPKV_1024, False, 40.0)]:
        fake_ruler_run(runs, tag, compressor, avg, query_aware)
    out = report(tmp_path)
    md = (out / "ruler.md").read_text()
    assert "| m | FullKV | 90.00 (1/13) |" in md and "| m | SnapKV 1024 · query-agnostic | 40.00 (1/13) |" in md
    assert "| m | SnapKV 1024 | vt | 80.00 |" in md
    assert (out / "ruler.csv").exists() and (out / "ruler_budget_curve.png").exists()


def test_ratio_runs_make_the_leaderboard_table_and_figure(tmp_path):
    """RULER runs with compressor.ratio: one row a method ranked by its mean over the ratios, full KV at
    ratio 0 for every line, runs with a token budget left out, fewer than 13 tasks marked."""
    runs = tmp_path / "runs"
    knorm = {"method": "knorm", "budget": None}
    adakv = {"method": "adakv", "budget": None, "window": 64, "kernel": 5, "pooling": "avgpool", "gqa": "mean"}
    cases = [("full", {"method": "full", "budget": None}, 95.0, True),
             ("knorm-25", {**knorm, "ratio": 0.25}, 80.0, True), ("knorm-75", {**knorm, "ratio": 0.75}, 40.0, True),
             ("adakv-25", {**adakv, "ratio": 0.25}, 90.0, True), ("adakv-75", {**adakv, "ratio": 0.75}, 70.0, False),
             ("snap-1024", SNAPKV_1024, 10.0, True)]
    for tag, compressor, avg, complete in cases:
        fake_ruler_run(runs, tag, compressor, avg, query_aware=False, complete=complete)
    out = report(tmp_path)
    md = (out / "leaderboard.md").read_text()
    assert "## m, RULER 4096 tokens, query-agnostic" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and "method" not in line]
    assert rows == ["| FullKV | 95.00 | – | – | – |",
                    "| AdaKV | 95.00 | 90.00 | 70.00* | 80.00 |",
                    "| Knorm | 95.00 | 80.00 | 40.00 | 60.00 |"]
    assert "SnapKV" not in md  # a budget in tokens is no leaderboard point
    assert (out / "leaderboard_m_4096_agnostic.png").exists()
    csv_rows = (out / "leaderboard.csv").read_text().splitlines()
    assert csv_rows[0] == "model,length,query_aware,method,ratio,ruler_average" and len(csv_rows) == 1 + 1 + 3 + 3
