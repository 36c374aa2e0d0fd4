"""scripts/gpu_check.py --smoke: every section of the GPU check runs on CPU with tiny shapes."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # its memory section probes the frontier in real processes
def test_smoke_runs_every_section(tmp_path):
    gpu_check = load()
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    assert all(s["status"] == "ok" for s in sections.values()), {n: s.get("error") for n, s in sections.items()}
    assert sections["exactness"]["result"]["all_selections_exact"]
    shared = sections["shared_prefill"]["result"]
    assert all(shared["tokens_equal_to_solo"].values())
    assert shared["together_s"] > 0 and 0 <= shared["together_answers_differ"] <= len(shared["settings"])
    assert sections["long_context"]["result"]["longest_run"]
    frontier = sections["memory"]["result"]["frontier"]
    assert all(row["probes"] for row in frontier.values())
    ragged = sections["head_adaptive"]["result"]
    assert ragged["kv_bytes_ratio"] == 1.0 < ragged["padded_kv_bytes_ratio"] < ragged["masked_kv_bytes_ratio"]
    assert ragged["decode_ratio"] > 0 and ragged["peak_ratio"] > 0
    items = sections["items"]["result"]
    assert items["items"] == 10 and sum(items["batch_sizes"]) == 10 and items["in_flight_items_per_s"] > 0
    rows = sections["long_generation"]["result"]["rows"]
    assert [row["method"] for row in rows] == ["full", "knorm", "streamingllm", "tova", "adakv"]
    assert all(row["final_kv_bytes"] < rows[0]["final_kv_bytes"] and row["decode_cuts"] > 0 for row in rows[1:])
    speculative = sections["speculative"]["result"]["rows"]
    assert {row["decoding"] for row in speculative} == {"greedy", "prompt_lookup", "assisted"}
    assert all(row["equals_greedy"] for row in speculative)
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check")


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    gpu_check = load()

    def broken(mode, clock):
        raise RuntimeError("planted failure")
    monkeypatch.setitem(gpu_check.SECTIONS, "environment", broken)
    assert gpu_check.main(["--smoke", "--out", str(tmp_path), "--sections", "environment,shared_prefill"]) == 1
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["environment"]["status"] == "failed" and "planted failure" in sections["environment"]["error"]
    assert sections["shared_prefill"]["status"] == "ok"


def test_unknown_section_is_an_error(capsys):
    assert load().main(["--smoke", "--sections", "speed,warp"]) == 2
    assert "--sections: 'warp' is not a section" in capsys.readouterr().err


def test_full_mode_without_a_gpu_is_an_error(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert load().main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
