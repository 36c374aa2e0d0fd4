"""The kvpress leaderboard end to end: the preset's multirun through the shared-prefill sweeper (one
job for every setting), then eval.report's leaderboard, on the tiny model (real Hydra, real files)."""
import subprocess
import sys

import pytest

from eval import leaderboard

pytestmark = pytest.mark.slow


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
    assert len(rows) == 1 + len(leaderboard.ENTRIES)  # full KV and one row an entry
    assert all(line.count("|") == 2 + 5 + 1 for line in rows)  # ratio 0, the four ratios, the average
    assert (tmp_path / "report" / "leaderboard_tiny-llama_1024_agnostic.png").exists()
