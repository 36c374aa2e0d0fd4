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


def fake_ruler_run(runs, tag, compressor, average, query_aware=True, complete=False, decoding=None):
    """A RULER run of model ``m`` at 4096 tokens whose only task, vt, scored ``average`` (``decoding``: its
    ``decoding`` section, a speculative run's)."""
    run = runs / "ruler" / "m" / tag
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "ruler", "model": {"name": "m"}, "compressor": compressor,
                                                     "query_aware": query_aware, **({"decoding": decoding} if decoding
                                                                                     else {})}))
    (run / "scores.json").write_text(json.dumps({"4096": {"tasks": {"vt": average}, "average": average,
                                                          "complete": complete, "counts": {}}}))


MIB = 2 ** 20


def cost(kv_mib, full_mib=64, masked_mib=None, prefill_s=2.0, compress_s=0.4, decode_s=0.75, tokens=50, passes=None,
         drafted=None, accepted=None):
    """A record's ``cost`` (the fields every prediction record carries; ``passes``: newer records', ``drafted`` and
    ``accepted``: a speculative run's)."""
    out = {"prompt_tokens": 4000, "kv_cache_bytes": int(kv_mib * MIB), "full_kv_bytes": int(full_mib * MIB),
           "kept_tokens": 1000, "prefill_s": prefill_s, "prefill_settings": 49, "compress_s": compress_s,
           "decode_s": decode_s, "decode_tokens": tokens}
    if passes is not None:
        out["decode_passes"] = passes
    if drafted is not None:
        out.update(drafted_tokens=drafted, accepted_tokens=accepted)
    if masked_mib is not None:
        out["masked_kv_bytes"] = int(masked_mib * MIB)
    return out


def two_items(share, masked=False):
    """Two records whose means are: KV ``share`` x 64 MiB of full KV's 64 MiB (kvpress: all of it where
    ``masked``), compression 20% of the prefill, 15 ms per decoded token (66.7 tokens/s), 0.98 passes per token
    (plain greedy: every token but the last fed)."""
    return [cost(60 * share, 60, 60 if masked else None, compress_s=0.2, decode_s=1.0, passes=49),
            cost(68 * share, 68, 68 if masked else None, compress_s=0.6, decode_s=0.5, passes=49)]


def write_records(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"index": i, "pred": "x", **({"cost": c} if c else {})}) + "\n"
                            for i, c in enumerate(records)))


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
    assert rows == ["| no_press (FullKV) | 95.00 | – | – | – |",     # kvpress's names, our label beside
                    "| adakv_snapkv (AdaKV) | 95.00 | 90.00 | 70.00* | 80.00 |",
                    "| knorm | 95.00 | 80.00 | 40.00 | 60.00 |"]
    assert "SnapKV" not in md  # a budget in tokens is no leaderboard point
    assert "Cost per item" not in md  # runs without cost fields: no cost table, no cost figures
    assert (out / "leaderboard_m_4096_agnostic.png").exists()
    assert not (out / "leaderboard_m_4096_agnostic_memory.png").exists()
    csv_rows = (out / "leaderboard.csv").read_text().splitlines()
    assert csv_rows[0] == ("model,length,query_aware,method,ratio,ruler_average,kv_mib,kv_share,kvpress_kv_mib,"
                           "kvpress_kv_share,compress_overhead,decode_ms_per_token,decode_tokens_per_s,passes_per_token,"
                           "accepted_share,cost_items")
    assert len(csv_rows) == 1 + 1 + 3 + 3 and all(row.endswith(",,,,,,,") for row in csv_rows[1:])  # blanks


def test_duo_attention_sits_at_its_head_ratio_as_kvpress_places_it(tmp_path):
    runs = tmp_path / "runs"
    duo = {"method": "duo_attention", "budget": None, "ratio": 0.0, "patterns": "/data/duo/SmolLM2"}
    cases = [("full", {"method": "full", "budget": None}, 95.0), ("duo-25", {**duo, "head_ratio": 0.25}, 85.0),
             ("duo-75", {**duo, "head_ratio": 0.75}, 60.0), ("knorm-25", {"method": "knorm", "budget": None,
                                                                         "ratio": 0.25}, 80.0)]
    for tag, compressor, avg in cases:
        fake_ruler_run(runs, tag, compressor, avg, query_aware=False, complete=True)
    rows = [line for line in (report(tmp_path) / "leaderboard.md").read_text().splitlines()
            if line.startswith("| ") and "method" not in line]
    assert rows == ["| no_press (FullKV) | 95.00 | – | – | – |",
                    "| knorm | 95.00 | 80.00 | – | 80.00 |",
                    "| duo_attention (DuoAttention, patterns /data/duo/SmolLM2) | 95.00 | 85.00 | 60.00 | 72.50 |"]


def capture_figures(monkeypatch):
    """The lines of every figure the leaderboard saves: ``{file name: [(label, colour, marker)]}``."""
    import matplotlib.colors
    from eval.report import leaderboard as board
    figures, save = {}, board.save_figure

    def keep(fig, path, **kw):
        figures[path.name] = [(line.get_label(), matplotlib.colors.to_hex(line.get_color()), line.get_marker())
                              for ax in fig.axes for line in ax.get_lines()]
        return save(fig, path, **kw)

    monkeypatch.setattr(board, "save_figure", keep)
    return figures


def test_leaderboard_gives_memory_overhead_decode_speed_and_kvpress_masked_bytes(tmp_path, monkeypatch):
    """Every entry at ratio 0.5 with cost fields (and knorm at 0.75 without): the cost table's values, the
    CSV's, kvpress's masked bytes beside head-adaptive methods and KVzip, kvpress's names on every line of
    the three figures, each line its own (colour, marker)."""
    from eval import leaderboard
    figures = capture_figures(monkeypatch)
    runs = tmp_path / "runs"
    masked = {"adakv", "critical_adakv", "adakv_expected_attention", "kvzip"}
    fake_ruler_run(runs, "full", {"method": "full", "budget": None}, 95.0, query_aware=False)
    write_records(runs / "ruler/m/full/pred/4096/vt.jsonl",
                  [cost(60, 60, compress_s=0.0, decode_s=1.0), None])  # and an out-of-memory record: no cost
    for entry, fields in leaderboard.ENTRIES.items():  # as settings() makes them
        setting = {"method": entry, **leaderboard.WINDOW_FAMILY, **fields, "budget": None, "ratio": 0.5}
        tag = f"{entry}-50"
        fake_ruler_run(runs, tag, setting, 50.0 + len(tag), query_aware=False)
        write_records(runs / f"ruler/m/{tag}/pred/4096/vt.jsonl", two_items(0.5, masked=entry in masked))
    fake_ruler_run(runs, "knorm-75", {"method": "knorm", "budget": None, "ratio": 0.75}, 30.0, query_aware=False)
    out = report(tmp_path)
    md = (out / "leaderboard.md").read_text()
    rows = {tuple(line.split(" | ")[:2]): line.split(" | ")[2:] for line in md.split("Cost per item")[1].splitlines()
            if line.startswith("| ") and "method" not in line}
    # one record had cost, an older one: no passes
    assert rows[("| no_press (FullKV)", "0")] == ["60.0", "100.0%", "0.0%", "20.00", "50.0", " |"]
    assert rows[("| knorm", "0.5")] == ["32.0", "50.0%", "20.0%", "15.00", "66.7", "0.98 |"]
    assert rows[("| knorm", "0.75")] == ["", "", "", "", "", " |"]                         # no cost: blanks
    assert rows[("| adakv_snapkv (AdaKV)", "0.5")] == ["32.0 (kvpress 64.0)", "50.0% (kvpress 100.0%)", "20.0%",
                                                       "15.00", "66.7", "0.98 |"]
    assert rows[("| kvzip", "0.5")][0] == "32.0 (kvpress 64.0)"
    assert rows[("| snapkv (SnapKV, window 64, kernel 5, pooling avgpool)", "0.5")][0] == "32.0"
    known = {"no_press (FullKV)", "random (Random, window 64)", "knorm", "streaming_llm", "tova", "keydiff",
             "ExpectedAttentionPress (ExpectedAttention)", "snapkv (SnapKV, window 64, kernel 5, pooling avgpool)",
             "pyramidkv (PyramidKV, window 64, kernel 5, pooling avgpool, schedule kvpress)", "adakv_snapkv (AdaKV)",
             "critical_adakv_snapkv (CriticalAdaKV)",
             "expected_attention (AdaKV, scorer expected_attention, scorer_epsilon 0.01)", "kvzip"}
    names = {name[2:] for name, _ in rows}
    assert known <= names  # every entry under kvpress's name, ours beside where it differs
    assert {name.split(" (")[0] for name in names} == \
        {leaderboard.KVPRESS_NAMES[entry] for entry in ["full", *leaderboard.ENTRIES]}
    csv_rows = {(r["method"], r["ratio"]): r for r in __import__("csv").DictReader((out / "leaderboard.csv").open())}
    adakv = csv_rows[("adakv_snapkv (AdaKV)", "0.5")]
    assert (adakv["kv_mib"], adakv["kv_share"], adakv["kvpress_kv_mib"], adakv["kvpress_kv_share"],
            adakv["compress_overhead"], adakv["decode_ms_per_token"], adakv["cost_items"]) == \
        ("32.0", "0.5", "64.0", "1.0", "0.2", "15.0", "2")
    assert csv_rows[("knorm", "0.5")]["kvpress_kv_mib"] == "32.0" and csv_rows[("knorm", "0.75")]["kv_mib"] == ""
    stem = "leaderboard_m_4096_agnostic"
    assert set(figures) == {f"{stem}.png", f"{stem}_memory.png", f"{stem}_time.png"}
    for name, lines in figures.items():
        methods = [(label, colour, marker) for label, colour, marker in lines if label in names - {"no_press (FullKV)"}]
        assert {label for label, _, _ in methods} == names - {"no_press (FullKV)"}, name
        assert len({(colour, marker) for _, colour, marker in methods}) == len(methods) == len(names) - 1, name
        assert (out / name).exists() and (out / name).with_suffix(".pdf").exists()
    assert "Pareto front" in [label for label, _, _ in figures[f"{stem}_memory.png"]]


def test_pareto_front_keeps_the_most_score_for_the_least_memory():
    from eval.report.leaderboard import _pareto
    points = [(10, 50), (20, 40), (20, 60), (30, 60), (40, 70), (5, 10), (40, 65)]
    assert _pareto(points) == [(5, 10), (10, 50), (20, 60), (40, 70)]


def test_a_run_is_named_by_the_kvpress_entry_its_fields_match():
    from eval.report.leaderboard import kvpress_entry, method_name
    window = {"window": 64, "kernel": 5, "pooling": "avgpool", "budget": None, "ratio": 0.5}
    assert kvpress_entry({"method": "adakv", **window}) == "adakv"
    assert kvpress_entry({"method": "adakv", **window, "scorer": "expected_attention", "scorer_epsilon": 0.01}) == \
        "adakv_expected_attention"
    other = {"method": "adakv", **window, "scorer": "expected_attention", "scorer_epsilon": 0.02}
    assert kvpress_entry(other) is None and method_name(other).startswith("AdaKV (")  # no entry: our label
    assert method_name({"method": "streamingllm", "budget": None, "ratio": 0.25}) == "streaming_llm"
    assert method_name({"method": "h2o", "budget": None, "ratio": 0.25}) == "H2O"


def test_ruler_and_longbench_tables_carry_the_cost_columns_blank_without_them(tmp_path):
    runs = tmp_path / "runs"
    fake_ruler_run(runs, "snap", SNAPKV_1024, 80.0)
    write_records(runs / "ruler/m/snap/pred/4096/vt.jsonl", two_items(0.25))
    fake_ruler_run(runs, "full", {"method": "full", "budget": None}, 90.0)              # an older run: no cost
    fake_run(runs, PAPER_MODEL_CFG, {**SNAPKV_1024, "window": 16, "tag": "w16"}, {"narrativeqa": 2.0})
    write_records(runs / "longbench/lwm-1m/w16/pred/narrativeqa.jsonl", two_items(0.25, masked=True))
    fake_run(runs, PAPER_MODEL_CFG, {**SNAPKV_1024, "window": 64, "tag": "w64"}, {"narrativeqa": 3.0})
    write_records(runs / "longbench/lwm-1m/w64/pred/narrativeqa.jsonl", [None])
    out = report(tmp_path)
    md = (out / "ruler.md").read_text()
    assert "| m | SnapKV 1024 | 4096 | 16.0 | 25.0% | 20.0% | 15.00 | 66.7 | 0.98 |" in md
    assert "| m | FullKV | 4096 |  |  |  |  |  |  |" in md
    ruler_csv = list(__import__("csv").DictReader((out / "ruler.csv").open()))
    assert [(r["setting"], r["task"], r["kv_mib"]) for r in ruler_csv] == \
        [("FullKV", "average", ""), ("SnapKV 1024", "average", "16.0"), ("FullKV", "vt", ""), ("SnapKV 1024", "vt", "")]
    ablation = {l[1]: l[-6:] for l in rows_of(out / "table_ablation.md")}
    assert ablation["SnapKV 1024 (window 16)"] == ["16.0 (kvpress 64.0)", "25.0% (kvpress 100.0%)", "20.0%", "15.00",
                                                   "66.7", "0.98 |"]
    assert ablation["SnapKV 1024 (window 64)"] == ["", "", "", "", "", " |"]
    assert "of full KV" in (out / "table_ablation.tex").read_text()
    lb_csv = {r["setting"]: r for r in __import__("csv").DictReader((out / "table_ablation.csv").open())}
    assert lb_csv["SnapKV 1024 (window 16)"]["compress_overhead"] == "0.2" and \
        lb_csv["SnapKV 1024 (window 64)"]["kv_mib"] == ""


def test_speculative_runs_are_labelled_apart_with_their_passes_and_accepted_drafts(tmp_path):
    """A speculative run of a setting beside its plain run: its own label and leaderboard board (never written over
    the plain run's cells), passes per token below one with the share of drafts accepted."""
    runs = tmp_path / "runs"
    setting = {"method": "knorm", "budget": None, "ratio": 0.5}
    for tag, decoding, records in (
            ("plain", None, [cost(32, 64, passes=49), cost(32, 64, passes=49)]),
            ("fast", {"speculative": "prompt_lookup", "draft_tokens": 10, "ngram": 2},
             [cost(32, 64, passes=20, drafted=100, accepted=29), cost(32, 64, passes=35, drafted=50, accepted=14)])):
        fake_ruler_run(runs, tag, setting, 40.0, query_aware=False, decoding=decoding)
        write_records(runs / f"ruler/m/{tag}/pred/4096/vt.jsonl", records)
    out = report(tmp_path)
    md = (out / "ruler.md").read_text()
    cells = "| 4096 | 32.0 | 50.0% | 20.0% | 15.00 | 66.7 |"
    assert f"| m | Knorm ratio 0.5 · query-agnostic · prompt lookup 10 {cells} 0.55 (29% accepted) |" in md
    assert f"| m | Knorm ratio 0.5 · query-agnostic {cells} 0.98 |" in md
    board = (out / "leaderboard.md").read_text()
    assert "## m, RULER 4096 tokens" in board and "## m · prompt lookup 10, RULER 4096 tokens" in board
    assert (out / "ruler.csv").read_text().count("0.55") == 1
