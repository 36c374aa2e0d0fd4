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
    _, _, scores, oom = grid_of(cells)
    assert oom[:, 2].all() and not oom[:, :2].any()
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
