"""Needle prompts: insertion at sentence boundaries, token counting, scoring, the app and resume."""
import json

import pytest

from conftest import compose
from eval.needle.build import Needle, boundary_before, insert_needles, overhead_tokens, prompt_ids, sentence_end_ids
from eval.needle.haystack import haystack_tokens
from eval.needle.score import exact_score, recall_score


def test_boundary_moves_back_to_a_sentence_end():
    tokens = [5, 6, 1, 7, 8, 9, 1, 4]
    assert boundary_before(tokens, 5, {1}) == 3
    assert boundary_before(tokens, 2, {1}) == 0
    assert boundary_before(tokens, 7, {1}) == 7


@pytest.mark.parametrize("depth", [0, 25, 50, 100])
def test_needle_lands_after_a_sentence_at_depth(smol_tokenizer, depth):
    stream = haystack_tokens(smol_tokenizer, "noise", 600)
    ends = sentence_end_ids(smol_tokenizer, stream)
    needle = Needle("The magic number is 4242.", "4242")
    context, points = insert_needles(smol_tokenizer, stream, [needle], [depth], ends)
    assert "The magic number is 4242." in context
    before = context.split("The magic number is 4242.")[0].strip()
    assert before == "" or before.endswith(".")
    assert abs(points[0] - len(stream) * depth / 100) <= 20
    assert smol_tokenizer.bos_token is None or smol_tokenizer.bos_token not in context


def test_whole_prompt_has_the_asked_length(smol_tokenizer):
    needles = [Needle("The magic number is 4242.", "4242")]
    overhead = overhead_tokens(smol_tokenizer, needles, "What is the magic number?", "template")
    for length in (500, 1500):
        stream = haystack_tokens(smol_tokenizer, "noise", length - overhead)
        context, _ = insert_needles(smol_tokenizer, stream, needles, [50], sentence_end_ids(smol_tokenizer, stream))
        ids = prompt_ids(smol_tokenizer, context, "What is the magic number?", "template")
        assert abs(len(ids) - length) <= 3


def test_folder_haystack_in_sorted_order(tmp_path, smol_tokenizer):
    (tmp_path / "b.txt").write_text("Second file.")
    (tmp_path / "a.txt").write_text("First file.")
    text = smol_tokenizer.decode(haystack_tokens(smol_tokenizer, str(tmp_path), 10))
    assert text.startswith("First file.")
    with pytest.raises(ValueError, match="needle.haystack"):
        haystack_tokens(smol_tokenizer, str(tmp_path / "missing"), 10)


def test_essays_haystack(shared_dir, smol_tokenizer):
    ids = haystack_tokens(smol_tokenizer, str(shared_dir / "haystack/paul_graham_essays"), 5000)
    assert len(ids) == 5000


def test_scores():
    assert recall_score("It is a spoonful of cardamom!", "a spoonful of cardamom") == 1.0
    assert recall_score("Cardamom.", "a spoonful of cardamom") == pytest.approx(1 / 3)
    assert recall_score("", "cardamom") == 0.0
    assert exact_score("The answer: Spoonful of cardamom.", "a spoonful of cardamom") == 1.0
    assert exact_score("cardamom spoonful", "a spoonful of cardamom") == 0.0


def test_app_writes_cells_heatmap_and_resumes(tmp_path):
    from eval.needle.__main__ import run
    overrides = ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", "needle.lengths=[300,400]",
                 "needle.depths=[0,100]", "needle.max_new_tokens=2", f"output_dir={tmp_path}"]
    run(compose("needle", overrides))
    cells = [json.loads(l) for l in (tmp_path / "needle.jsonl").read_text().splitlines()]
    assert len(cells) == 4
    assert set(cells[0]) >= {"context_length", "depth_percent", "score", "response"}
    assert all(0 <= c["score"] <= 1 for c in cells)
    assert (tmp_path / "heatmap.png").stat().st_size > 0 and (tmp_path / "heatmap.pdf").exists()
    run(compose("needle", overrides + ["needle.lengths=[300,400,500]"]))
    cells = [json.loads(l) for l in (tmp_path / "needle.jsonl").read_text().splitlines()]
    assert sorted((c["context_length"], c["depth_percent"]) for c in cells) == \
        [(300, 0.0), (300, 100.0), (400, 0.0), (400, 100.0), (500, 0.0), (500, 100.0)]


def test_bad_grid_values(tmp_path):
    from eval.needle.__main__ import run
    with pytest.raises(ValueError, match="needle.depths"):
        run(compose("needle", ["model=tiny-llama", "needle.depths=[150]", f"output_dir={tmp_path}"]))
    with pytest.raises(ValueError, match="needle.grid"):
        run(compose("needle", ["model=tiny-llama", "needle.grid=log", f"output_dir={tmp_path}"]))


def test_heatmap_marks_oom(tmp_path):
    from eval.needle.heatmap import grid_of, save_heatmap
    cells = [{"context_length": n, "depth_percent": d, "score": 1.0 if n < 3000 else None, "oom": n >= 3000}
             for n in (1000, 2000, 3000) for d in (0, 50)]
    _, _, scores, status = grid_of(cells)
    assert (status[:, 2] == "OOM").all() and not (status[:, :2] != "").any()
    assert save_heatmap(cells, tmp_path / "h.png", "t", trained_context=2500)[0].exists()


def test_multi_needle_cells_score_every_answer(tmp_path):
    from eval.needle.__main__ import run
    overrides = ["model=tiny-llama", "compressor=full", "needle.lengths=[300]", "needle.depths=[20]",
                 "needle.max_new_tokens=2", f"output_dir={tmp_path}",
                 "needle.extra_needles=[{needle: 'The second key is 99.', answer: '99'}]"]
    run(compose("needle", overrides))
    cell = json.loads((tmp_path / "needle.jsonl").read_text().splitlines()[0])
    assert 0 <= cell["score"] <= 1 and cell["input_tokens"] > 250


def test_needle_depths_spread_after_the_first():
    from eval.needle.build import needle_depths
    assert needle_depths(40, 3) == [40, 60, 80]


def test_longbench_contexts_as_haystack(smol_tokenizer):
    ids = haystack_tokens(smol_tokenizer, "longbench:multi_news:eval/data/longbench_sample", 3000)
    assert len(ids) == 3000


# The 45 "Token Limit" labels of the SnapKV paper's LWM-Text-Chat-1M needle figure.
PAPER_FIGURE_LENGTHS = [
    1000, 7513, 14026, 20539, 27051, 33564, 40077, 46590, 53103, 59616, 66128, 72641, 79154, 85667, 92180,
    98693, 105206, 111718, 118231, 124744, 134000, 144231, 154462, 164692, 174923, 185154, 195385, 205615,
    215846, 226077, 236308, 246538, 256769, 267000, 277231, 287462, 297692, 307923, 318154, 328385, 338615,
    348846, 359077, 369308, 379538]


def test_paper_grid_is_the_figure():
    from eval.needle.grid import depths_from, lengths_from
    cfg = compose("needle", ["needle.grid=paper"]).needle
    assert lengths_from(cfg) == PAPER_FIGURE_LENGTHS
    assert depths_from(cfg) == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]


def test_numbers_typed_on_the_command_line_are_text_where_text_is_expected(tmp_path):
    import subprocess
    import sys
    args = [sys.executable, "-m", "eval.needle", "model=tiny-llama", "compressor=full", "needle.lengths=[300]",
            "needle.depths=50", "needle.max_new_tokens=2", "needle.needle=The code is 3.10 today.",
            "needle.answer=3.10", "needle.question=42", f"output_dir={tmp_path}"]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["needle.needles"] == [["The code is 3.10 today.", "3.10"]] and settings["needle.question"] == "42"
    bad = subprocess.run(args[:-1] + ["needle.answer=[1,2]", f"output_dir={tmp_path}/b"], capture_output=True,
                         text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("error: needle.answer must be text")


def test_numeric_answer_from_a_composed_config(tmp_path):
    from eval.needle.__main__ import read_task
    task = read_task(compose("needle", ["needle.answer=58213", "needle.needle=The passkey is 58213."]))
    assert task.needles[0].answer == "58213"


def needle_app(tmp_path, *extra):
    from eval.needle.__main__ import run
    return run(compose("needle", ["model=tiny-llama", "compressor=full", "needle.max_new_tokens=2",
                                  f"output_dir={tmp_path}", *extra]))


def test_paper_preset_requires_a_haystack(tmp_path, monkeypatch):
    from eval.needle.__main__ import run
    monkeypatch.delenv("NEEDLE_HAYSTACK", raising=False)
    with pytest.raises(ValueError, match="needle.haystack is required"):
        run(compose("needle", ["experiment=paper_needle", f"output_dir={tmp_path}"]))


def test_length_shorter_than_the_fixed_prompt_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"needle.lengths: \[64\] are not longer than the prompt's fixed part"):
        needle_app(tmp_path, "needle.lengths=[64,300]", "needle.depths=[0]")


def test_out_of_memory_lengths_skip_longer_ones_and_retry(tmp_path, monkeypatch):
    from eval.runner import Runner
    real, calls = Runner.generate, []

    def small_gpu(self, ids, *args, **kwargs):
        calls.append(ids.shape[1])
        if ids.shape[1] > 350:
            raise torch_oom()
        return real(self, ids, *args, **kwargs)

    monkeypatch.setattr(Runner, "generate", small_gpu)
    needle_app(tmp_path, "needle.lengths=[300,400,500,600]", "needle.depths=[0,100]")
    cells = {(c["context_length"], c["depth_percent"]): c for c in map(json.loads, (tmp_path / "needle.jsonl").open())}
    assert len(cells) == 8 and max(calls) < 450                     # 500 and 600 never ran
    assert [cells[(n, 0.0)]["oom"] for n in (300, 400, 500, 600)] == [False, True, True, True]
    assert "skipped" in cells[(500, 0.0)] and "skipped" not in cells[(400, 0.0)]
    monkeypatch.setattr(Runner, "generate", real)
    needle_app(tmp_path, "needle.lengths=[300,400,500,600]", "needle.depths=[0,100]")   # resume: nothing to do
    assert len((tmp_path / "needle.jsonl").read_text().splitlines()) == 8
    needle_app(tmp_path, "needle.lengths=[300,400,500,600]", "needle.depths=[0,100]", "needle.retry_oom=true")
    cells = [json.loads(l) for l in (tmp_path / "needle.jsonl").read_text().splitlines()]
    assert len(cells) == 8 and not any(c["oom"] for c in cells)
    assert all(0 <= c["depth_achieved"] <= 100 and c["needle_token_position"] >= 0 for c in cells)
    assert all({"recall", "exact", "rouge1"} <= set(c) for c in cells)


def torch_oom():
    import torch
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_cell_whose_process_was_killed_is_a_failure_not_an_oom(tmp_path):
    needle_app(tmp_path, "needle.lengths=[300]", "needle.depths=[0]")
    (tmp_path / "running.json").write_text(json.dumps({"context_length": 300, "depth_percent": 100.0}))
    needle_app(tmp_path, "needle.lengths=[300]", "needle.depths=[0,100]")
    cells = [json.loads(l) for l in (tmp_path / "needle.jsonl").read_text().splitlines()]
    killed = [c for c in cells if c.get("failed")]
    assert len(cells) == 2 and len(killed) == 1 and killed[0]["oom"] is False and "killed" in killed[0]["failed"]
    needle_app(tmp_path, "needle.lengths=[300]", "needle.depths=[0,100]", "needle.retry_failed=true")
    cells = [json.loads(l) for l in (tmp_path / "needle.jsonl").read_text().splitlines()]
    assert len(cells) == 2 and not any(c.get("failed") for c in cells)
    assert not (tmp_path / "running.json").exists()


def test_dry_run_plans_the_paper_grid_without_loading_anything(tmp_path, monkeypatch):
    import eval.runner
    from eval.needle.__main__ import run
    monkeypatch.setattr(eval.runner, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(eval.runner, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))
    plan = run(compose("needle", ["experiment=paper_needle", "needle.haystack=noise", "needle.dry_run=true",
                                  "needle.memory_gib=80", f"output_dir={tmp_path}"]))
    assert plan["cells"] == 450 and plan["cells_done"] == 0
    fits = [r["fits"] for r in plan["per_length"]]
    assert all(fits)                                  # the paper: SnapKV 1024 reaches 380K on one 80 GB GPU
    assert json.loads((tmp_path / "plan.json").read_text())["lengths"] == PAPER_FIGURE_LENGTHS
    full = run(compose("needle", ["experiment=paper_needle", "compressor=full", "needle.haystack=noise",
                                  "needle.dry_run=true", "needle.memory_gib=80", f"output_dir={tmp_path}/full"]))
    full_fits = [r["fits"] for r in full["per_length"]]
    assert full_fits[0] and not full_fits[-1] and full_fits == sorted(full_fits, reverse=True)


def test_the_needle_to_a_million_tokens_is_planned_to_fit_one_80_gib_gpu(tmp_path, monkeypatch):
    """``experiment=needle_1m``: the paper's setting and depths, 45 lengths to LWM's trained 1,048,576 tokens; with
    the chunked prefill every length is planned to fit 80 GiB, the longest at about 39 GiB; with the model's one-pass
    prefill it would not."""
    import eval.runner
    from eval.needle.__main__ import run
    monkeypatch.setattr(eval.runner, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    base = ["experiment=needle_1m", "needle.haystack=noise", "needle.dry_run=true", "needle.memory_gib=80"]
    plan = run(compose("needle", [*base, f"output_dir={tmp_path}"]))
    lengths = [r["context_length"] for r in plan["per_length"]]
    assert len(lengths) == 45 and lengths[0] == 1000 and lengths[-1] == 1_048_576 and plan["cells"] == 450
    assert plan["depths"] == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    assert all(r["fits"] for r in plan["per_length"])
    assert 35 * 2**30 < plan["per_length"][-1]["predicted_peak_bytes"] < 50 * 2**30
    one_pass = run(compose("needle", [*base, "model.prefill_chunk=null", f"output_dir={tmp_path}/one_pass"]))
    assert not one_pass["per_length"][-1]["fits"]


def test_heatmap_labels_are_exact_token_counts_and_lines_are_placed(tmp_path):
    import matplotlib.pyplot as plt
    from eval.needle.heatmap import _boundary, draw, frontier_from_bench, frontier_from_cells
    cells = [{"context_length": n, "depth_percent": d, "score": 0.5, "oom": n > 2000}
             for n in (1500, 2000, 2500, 3000) for d in (0, 100)]
    fig, ax = plt.subplots()
    draw(ax, cells, "t", frontier=frontier_from_cells(cells), trained_context=3000)   # no StopIteration
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["1500", "2000", "2500", "3000"]
    assert [line.get_xdata()[0] for line in ax.lines] == [1.5]        # after 2000: full KV's last length
    plt.close(fig)
    assert frontier_from_cells(cells) == 2000 and _boundary([1500, 2000, 2500], 2100) == 1.5
    assert frontier_from_cells([{"context_length": 1, "depth_percent": 0, "oom": False}]) is None
    rows = [{"method": "full", "input_tokens": n, "oom": n >= 32768, "batch": 1} for n in (16384, 32768)]
    assert frontier_from_bench(rows) == 16384


def test_rouge1_scorer_is_the_harness_one():
    from eval.needle.score import rouge1_score
    needle = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    assert rouge1_score(needle, needle) == pytest.approx(1.0)
    assert rouge1_score("eat a sandwich and sit in Dolores Park on a sunny day.", needle) == pytest.approx(16 / 22)
    assert rouge1_score("", needle) == 0.0
