"""eval.lines: the seeded LongEval-Lines generator, its scoring, the app on the grid machinery,
and the paper's pooling and hyperparameter presets."""
import json
import subprocess
import sys

import pytest

from conftest import compose
from eval.lines.generate import LinesPrompts, asked_index, exact_value, make_lines


def test_generator_is_seeded_with_distinct_keys():
    a, b = make_lines(500, seed=3), make_lines(500, seed=3)
    assert a == b and a != make_lines(500, seed=4)
    assert len({line.key for line in a}) == 500
    assert all(1 <= line.value <= 50000 for line in a)
    assert a[0].text() == f"line {a[0].key}: REGISTER_CONTENT is <{a[0].value}>\n"
    assert a[0].key.count("-") == 1
    with pytest.raises(ValueError, match="distinct keys"):
        make_lines(10**6, seed=0)


def test_asked_line_by_depth_and_exact_scoring():
    assert [asked_index(11, d) for d in (0, 50, 100)] == [0, 5, 10]
    assert exact_value("The REGISTER_CONTENT is <10536>.", 10536) == 1.0
    assert exact_value("line 2 has 10536", 10536) == 0.0          # the first number counts (LongEval)
    assert exact_value("I do not know", 10536) == 0.0


def test_prompts_have_the_asked_length(smol_tokenizer):
    prompts = LinesPrompts(smol_tokenizer, "template", seed=0, pool=800)
    for length in (600, 2000):
        ids, asked, index, _ = prompts.build(length, 50)
        assert length - 25 <= len(ids) <= length
        text = smol_tokenizer.decode(ids)
        assert text.count("REGISTER_CONTENT is <") == prompts.count_for(length)
        assert text.rstrip().endswith("Answer with the number only.<|im_end|>\n<|im_start|>assistant") \
            and f"in line {asked.key}?" in text
    with pytest.raises(ValueError, match="lines.lengths: 50 tokens hold no line"):
        prompts.count_for(50)


def test_app_runs_the_grid_and_resumes(tmp_path):
    from eval.lines.__main__ import run
    overrides = ["model=tiny-llama", "compressor.budget=96", "compressor.window=8", "lines.lengths=[200,300]",
                 "lines.depths=[0,100]", "lines.max_new_tokens=2", f"output_dir={tmp_path}"]
    run(compose("lines", overrides))
    cells = [json.loads(l) for l in (tmp_path / "lines.jsonl").read_text().splitlines()]
    assert len(cells) == 4 and all(c["score"] in (0.0, 1.0) and c["cache_tokens"] == 96 for c in cells)
    assert {c["asked_line"] for c in cells if c["depth_percent"] == 0} == {0}
    assert (tmp_path / "heatmap.png").exists()
    run(compose("lines", overrides + ["lines.depths=[0,50,100]"]))
    assert len((tmp_path / "lines.jsonl").read_text().splitlines()) == 6


def test_paper_pooling_preset_is_one_multirun_of_two_settings():
    cfg = compose("lines", ["experiment=paper_pooling"], hydra_node=True)
    assert cfg.model.name == "mistral-7b-instruct-v0.2"
    assert (cfg.compressor.window, cfg.compressor.kernel, cfg.compressor.budget) == (16, 5, 1024)
    assert dict(cfg.hydra.sweeper.params) == {"compressor.pooling": "maxpool,none"}
    assert min(cfg.lines.lengths) >= 4000 and max(cfg.lines.lengths) <= 30000


def test_paper_hyperparams_preset_has_six_distinct_jobs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.longbench", "-m", "experiment=paper_hyperparams",
                           "model=tiny-llama", "longbench.datasets=[multi_news]",
                           "longbench.data_dir=eval/data/longbench_sample", "longbench.limit=1",
                           "longbench.max_new_tokens=1", f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = sorted(p.name for p in (tmp_path / "tiny-llama").iterdir())
    assert runs == ["snapkv-b1024-w16-k7-maxpool-repeat", "snapkv-b1024-w32-k1-none-repeat",
                    "snapkv-b1024-w32-k5-maxpool-repeat", "snapkv-b1024-w32-k7-maxpool-repeat",
                    "snapkv-b1024-w32-k9-maxpool-repeat", "snapkv-b1024-w64-k7-maxpool-repeat"]
    settings = json.loads((tmp_path / "tiny-llama" / runs[0] / "settings.json").read_text())
    assert (settings["model.dtype"], settings["model.protocol"], settings["compressor.gqa"]) == \
        ("float16", "snapkv", "repeat")  # Table 1's protocol (pred_snap.py)
