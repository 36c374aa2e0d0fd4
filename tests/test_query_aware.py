"""query_aware=false: the question part is appended after the context is compressed (kvpress's
query-agnostic setting). The split of every template, the runner's second turn, and the app."""
import json

import pytest
import torch

import snapkv
from conftest import compose
from eval.chat import encode_chat, encode_chat_split
from eval.longbench.prompt import PROMPTS, build_input_ids, build_split_ids, question_part
from eval.needle.build import PROMPTS as NEEDLE_PROMPTS, prompt_ids, prompt_split_ids
from eval.runner import Runner
from tiny_models import tiny_model

CONTEXT = "The archive of the old harbour town lists every ship. " * 30 + "Last line of the passage."
QUESTION = "Which ship came first?"


def row(dataset):
    return {"input": QUESTION, "context": CONTEXT, "answers": ["x"], "length": 1, "dataset": dataset,
            "language": "en", "all_classes": ["a", "b"], "_id": "r0"}


@pytest.mark.parametrize("dataset", sorted(PROMPTS))
@pytest.mark.parametrize("chat_format", ["template", "llama2"])
def test_every_longbench_template_splits_after_its_context(smol_tokenizer, dataset, chat_format):
    r = row(dataset)
    ids, question = build_split_ids(smol_tokenizer, r, dataset, 7500, chat_format)
    assert ids == build_input_ids(smol_tokenizer, r, dataset, 7500, chat_format)  # the same prompt, split
    context_text, question_text = smol_tokenizer.decode(ids[:-question]), smol_tokenizer.decode(ids[-question:])
    assert context_text.rstrip().endswith("Last line of the passage.")
    after = question_part(dataset, r).strip()
    assert after and after in question_text  # the template's text after {context}, the question in it
    assert QUESTION not in context_text
    if "{input}" in PROMPTS[dataset][PROMPTS[dataset].index("{context}"):]:
        assert QUESTION in question_text


def test_text_before_the_context_stays_with_it(smol_tokenizer):
    r = row("qasper")  # "You are given a scientific article and a question. ..." precedes {context}
    ids, question = build_split_ids(smol_tokenizer, r, "qasper", 7500, "template")
    head = PROMPTS["qasper"][:PROMPTS["qasper"].index("{context}")]
    assert head.strip()[:40] in smol_tokenizer.decode(ids[:-question])


def test_a_truncated_prompt_still_splits_at_its_question(smol_tokenizer):
    r = {**row("hotpotqa"), "context": "Filler words go on. " * 800 + "Last line of the passage."}
    ids, question = build_split_ids(smol_tokenizer, r, "hotpotqa", 300, "template")
    assert ids == build_input_ids(smol_tokenizer, r, "hotpotqa", 300, "template")
    assert QUESTION in smol_tokenizer.decode(ids[-question:])
    assert QUESTION not in smol_tokenizer.decode(ids[:-question])


@pytest.mark.parametrize("prompt", sorted(NEEDLE_PROMPTS))
def test_the_needle_prompt_splits_at_its_retrieval_question(smol_tokenizer, prompt):
    ids, question = prompt_split_ids(smol_tokenizer, CONTEXT, QUESTION, "template", prompt)
    assert ids == prompt_ids(smol_tokenizer, CONTEXT, QUESTION, "template", prompt)
    assert QUESTION in smol_tokenizer.decode(ids[-question:])
    assert smol_tokenizer.decode(ids[:-question]).rstrip().endswith("Last line of the passage.")


def test_a_straddling_token_goes_with_the_question(smol_tokenizer):
    text = "abc" + "defg" * 3
    ids, question = encode_chat_split(smol_tokenizer, text, "none", 5)  # inside a token
    assert ids == encode_chat(smol_tokenizer, text, "none")
    assert "fg" in smol_tokenizer.decode(ids[-question:]) and len(smol_tokenizer.decode(ids[:-question])) <= 5


def run_ids(n=150, seed=3):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_full_kv_gives_the_same_tokens_both_ways():
    runner = Runner(tiny_model("llama-gqa"))
    ids = run_ids()
    inside = runner.generate(ids, snapkv.FullKV(), 8)
    after = runner.generate(ids, snapkv.FullKV(), 8, question_tokens=12)
    assert inside.tokens == after.tokens


def test_the_question_is_kept_uncompressed_after_the_compressed_context():
    runner = Runner(tiny_model("llama-gqa"))
    ids = run_ids()
    cfg = snapkv.SnapKV(budget=48, window=8, kernel=5)
    after = runner.generate(ids, cfg, 1, question_tokens=12)
    assert after.cache_lengths == [48] * len(after.cache_lengths)  # the context of 138 tokens compressed
    # the same as compressing the context alone, then feeding the question as a second turn by hand
    from transformers import DynamicCache
    model = runner.model
    with snapkv.compress(model, cfg), torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :-12], cache=cache, use_cache=True)
        assert cache.layers[0].keys.shape[-2] == 48
        logits = model(ids[:, -12:], cache=cache, use_cache=True).logits[:, -1]
        assert cache.layers[0].keys.shape[-2] == 60  # the question appended as it is
    assert after.tokens == [int(logits.argmax())]


def test_shared_prefill_and_decoding_together_keep_the_split():
    runner = Runner(tiny_model("llama-gqa"))
    ids = run_ids()
    settings = [snapkv.FullKV(), snapkv.SnapKV(budget=48, window=8, kernel=5),
                snapkv.PyramidKV(budget=48, window=8, kernel=5)]
    alone = [runner.generate(ids, cfg, 6, question_tokens=12).tokens for cfg in settings]
    shared = [g.tokens for g in runner.generate_shared(ids, settings, 6, question_tokens=12)]
    assert shared == alone
    together = [g.tokens for g in runner.generate_shared(ids, settings, 6, question_tokens=12, together=True)]
    assert [t[:1] for t in together] == [t[:1] for t in alone]  # the first token comes from each own forward


def test_the_question_needs_a_context_before_it():
    runner = Runner(tiny_model("llama-gqa"))
    with pytest.raises(snapkv.InputError, match="question_tokens=150"):
        runner.generate(run_ids(), snapkv.FullKV(), 2, question_tokens=150)


def write_rows(path, n=2):
    path.write_text("".join(json.dumps({**row("hotpotqa"), "_id": f"id{i}", "input": f"Question {i}?"}) + "\n"
                            for i in range(n)))


def test_the_app_runs_query_agnostic_into_its_own_folder_and_fingerprint(tmp_path):
    from eval.longbench.__main__ import run
    write_rows(tmp_path / "hotpotqa.jsonl")
    base = ["model=tiny-llama", "compressor.budget=64", "compressor.window=8", "longbench.datasets=[hotpotqa]",
            f"longbench.data_dir={tmp_path}", "longbench.max_new_tokens=3"]
    cfg = compose("longbench", base + ["query_aware=false"], hydra_node=True)
    assert cfg.hydra.run.dir.endswith("/snapkv-b64-w8-k7-maxpool-mean-query-agnostic")
    assert compose("longbench", base, hydra_node=True).hydra.run.dir.endswith("/snapkv-b64-w8-k7-maxpool-mean")
    run(compose("longbench", base + ["query_aware=false", f"output_dir={tmp_path}/agnostic"]))
    run(compose("longbench", base + [f"output_dir={tmp_path}/aware"]))
    agnostic = json.loads((tmp_path / "agnostic" / "settings.json").read_text())
    aware = json.loads((tmp_path / "aware" / "settings.json").read_text())
    assert agnostic["query_aware"] is False and "query_aware" not in aware  # older folders stay valid
    with pytest.raises(snapkv.InputError, match="query_aware false -> true|query_aware"):
        run(compose("longbench", base + [f"output_dir={tmp_path}/agnostic"]))
    lines = (tmp_path / "agnostic" / "pred" / "hotpotqa.jsonl").read_text().splitlines()
    assert len(lines) == 2


def test_query_aware_takes_only_true_or_false_and_tasks_that_split(tmp_path):
    from eval.lines.__main__ import run as run_lines
    from eval.longbench.__main__ import run
    write_rows(tmp_path / "hotpotqa.jsonl")
    with pytest.raises(snapkv.InputError, match="query_aware='no' is not allowed; choose true or false"):
        run(compose("longbench", ["model=tiny-llama", f"longbench.data_dir={tmp_path}", "query_aware=no",
                                  "longbench.datasets=[hotpotqa]",
                                  f"output_dir={tmp_path}/x"]))
    with pytest.raises(snapkv.InputError, match="query_aware=false is not allowed for lines"):
        run_lines(compose("lines", ["model=tiny-llama", "query_aware=false", f"output_dir={tmp_path}/y"]))
