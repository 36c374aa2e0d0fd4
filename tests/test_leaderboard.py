"""The kvpress leaderboard end to end: the preset's multirun through the shared-prefill sweeper (one
job for every setting), then eval.report's leaderboard, on the tiny model (real Hydra, real files)."""
import subprocess
import sys

import pytest

from eval import leaderboard


def test_every_entry_has_its_kvpress_name_and_every_setting_is_matched_back_to_its_entry():
    """The report names each leaderboard setting by kvpress's registry: the setting ``settings()`` makes of
    an entry is that entry again (adakv and adakv_expected_attention share a method, told apart by the scorer)."""
    from eval.report.leaderboard import kvpress_entry, method_name
    assert set(leaderboard.KVPRESS_NAMES) == {"full", *leaderboard.ALL_ENTRIES} > {"full", *leaderboard.ENTRIES}
    assert "chunkkv" in leaderboard.ALL_ENTRIES and "chunkkv" not in leaderboard.ENTRIES  # the query-aware board
    assert len(set(leaderboard.KVPRESS_NAMES.values())) == len(leaderboard.KVPRESS_NAMES)
    entries = [name for name in leaderboard.ALL_ENTRIES for _ in leaderboard.RATIOS]
    settings = [{"method": "full"}] + [{"method": name, **leaderboard.WINDOW_FAMILY, **fields, "budget": None,
                                        "ratio": r} for name, fields in leaderboard.ALL_ENTRIES.items()
                                       for r in leaderboard.RATIOS]
    assert kvpress_entry(settings[0]) == "full"
    for entry, setting in zip(entries, settings[1:]):
        assert kvpress_entry(setting) == entry
        assert method_name(setting).split(" (")[0] == leaderboard.KVPRESS_NAMES[entry]


@pytest.mark.slow
def test_the_preset_runs_as_one_job_and_reports_every_entry_at_every_ratio(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.ruler", "-m", "experiment=kvpress_leaderboard",
                           "model=tiny-llama", "ruler.tasks=[niah_single_1]", "ruler.lengths=[1024]",
                           "ruler.samples=1", f"hydra.sweep.dir={tmp_path}/runs"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = 1 + len(leaderboard.ENTRIES) * len(leaderboard.RATIOS)  # full KV's four ratios are one
    jobs = (1 + len(leaderboard.ENTRIES)) * len(leaderboard.RATIOS)
    assert f"{jobs} jobs -> 1 job(s)" in proc.stdout and f"x{settings} settings" in proc.stderr + proc.stdout
    folders = sorted(p.parent.name for p in (tmp_path / "runs").glob("tiny-llama/*/scores.json"))
    assert len(folders) == settings and all(f == "full" or f.endswith("-query-agnostic") for f in folders)
    proc = subprocess.run([sys.executable, "-m", "eval.report", f"report.runs={tmp_path}/runs",
                           f"report.out={tmp_path}/report"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "report" / "leaderboard.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "method" not in line]
    board, costs = md.split("Cost per item")  # every record carries its cost: a second table
    rows = [line for line in board.splitlines() if line.startswith("| ") and "method" not in line]
    assert len(rows) == 1 + len(leaderboard.ENTRIES)  # full KV and one row an entry
    assert all(line.count("|") == 2 + 5 + 1 for line in rows)  # ratio 0, the four ratios, the average
    names = {line.split(" | ")[0][2:].split(" (")[0] for line in rows}
    assert names == {leaderboard.KVPRESS_NAMES[e] for e in ["full", *leaderboard.ENTRIES]}  # kvpress's names
    cost_rows = [line.split(" | ") for line in costs.splitlines() if line.startswith("| ") and "method" not in line]
    assert len(cost_rows) == settings and all(row[2] and row[5] != " |" for row in cost_rows)  # no blanks
    import snapkv
    masked = {leaderboard.KVPRESS_NAMES[e] for e, fields in leaderboard.ENTRIES.items()  # head-adaptive: kvpress masks
              if snapkv.METHODS[fields.get("method", e)].head_adaptive}
    assert {"adakv_snapkv", "critical_adakv_snapkv", "expected_attention", "kvzip", "adakv_compactor"} <= masked
    assert all(("(kvpress " in row[2]) == (row[0][2:].split(" (")[0] in masked) for row in cost_rows)
    for suffix in ("", "_memory", "_time"):
        assert (tmp_path / "report" / f"leaderboard_tiny-llama_1024_agnostic{suffix}.png").exists()
