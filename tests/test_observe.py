"""eval.observe: the paper's hit-rate arithmetic on hand-made attention, the captured attention
against the model's own, and the app (Figures 2 and 3, resume, the §4.2 variants)."""
import json
import math

import pytest
import torch

from conftest import compose
from eval.observe.hits import hit_rates, overlap, selected
from tiny_models import tiny_model


def test_hit_rate_on_a_hand_made_attention_tensor():
    # one head, prefix of 10 positions, k = floor(0.3 * 10) = 3 kept: the votes pick 1, 4, 7
    votes = torch.tensor([[0.1, 0.9, 0.0, 0.2, 0.8, 0.1, 0.0, 0.7, 0.3, 0.0]])
    assert selected(votes, 0.3)[0].nonzero().flatten().tolist() == [1, 4, 7]
    # two current queries; above theta = 0.2: q0 -> 1, 4, 9 ; q1 -> 4, 5  (5 important pairs, 3 hits)
    current = torch.zeros(1, 2, 10)
    current[0, 0, [1, 4, 9]] = torch.tensor([0.3, 0.4, 0.25])
    current[0, 1, [4, 5]] = torch.tensor([0.5, 0.3])
    current[0, 1, 7] = 0.2                                   # not above theta: not important
    rate, important = hit_rates(current, votes, p=0.3, theta=0.2)
    assert important.tolist() == [5] and rate.tolist() == [pytest.approx(3 / 5)]
    # a head with nothing important has no hit rate
    rate, important = hit_rates(torch.zeros(1, 2, 10), votes, p=0.3, theta=0.2)
    assert important.tolist() == [0] and math.isnan(rate[0])
    # max pooling widens the vote before top-k: kernel 3 makes 0 and 2 as strong as 1
    assert selected(votes, 0.3, "maxpool", 3)[0].nonzero().flatten().tolist() == [0, 1, 2]
    b = torch.tensor([[0.9, 0.0, 0.0, 0.2, 0.8, 0.1, 0.0, 0.7, 0.3, 0.0]])
    assert overlap(votes, b, 0.3).tolist() == [pytest.approx(2 / 3)]


def test_counts_over_a_longer_prefix_give_every_shorter_prefix_its_hit_rate():
    """layer_records counts the important pairs of the response rows once and slices the counts per
    prompt window: the same integers, so the same rates, as each prefix on its own."""
    from eval.observe.hits import counted_hit_rates, important_counts
    torch.manual_seed(0)
    current = torch.softmax(torch.randn(3, 16, 200) * 3, dim=-1)
    counts = important_counts(current, 0.01)
    for prefix in (1, 37, 120, 200):
        votes = torch.rand(3, prefix)
        for pooling, kernel in (("none", 1), ("maxpool", 5)):
            important = current[:, :, :prefix] > 0.01          # the paper's definition, pair by pair
            hits = (important & selected(votes, 0.1, pooling, kernel)[:, None, :]).sum(dim=(1, 2))
            total = important.sum(dim=(1, 2))
            for rate, important_pairs in (counted_hit_rates(counts[:, :prefix], votes, 0.1, pooling, kernel),
                                          hit_rates(current[:, :, :prefix], votes, 0.1, 0.01, pooling, kernel)):
                assert torch.equal(important_pairs, total)
                torch.testing.assert_close(rate, torch.where(total > 0, hits / total.clamp(min=1), float("nan")),
                                           rtol=0, atol=0, equal_nan=True)


def test_captured_attention_equals_the_model_attention():
    from eval.observe.capture import row_attention
    from snapkv.architectures import queries_at
    model = tiny_model("llama-gqa", attn="eager")
    ids = torch.randint(0, 128, (1, 40))
    seen = {}

    def hook(module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        q = queries_at(module, kwargs["hidden_states"], kwargs["position_embeddings"], slice(10, 40))
        rows = torch.arange(10, 40)
        keys = cache.layers[module.layer_idx].keys
        seen[module.layer_idx] = torch.cat([p for _, p in row_attention(module, q, rows, keys)])

    from transformers import DynamicCache
    handles = [l.self_attn.register_forward_hook(hook, with_kwargs=True) for l in model.model.layers]
    with torch.no_grad():
        out = model(ids, cache=DynamicCache(config=model.config), use_cache=True, output_attentions=True)
    for h in handles:
        h.remove()
    for layer, attn in enumerate(out.attentions):
        assert torch.allclose(seen[layer], attn[0, :, 10:40].float(), atol=1e-5)


def lb_rows(n=3):
    words = " ".join(f"Fact {i} is number {i * 7}." for i in range(120))
    return [{"input": f"What is fact {i}?", "context": words, "answers": [" ".join(["the answer is"] * 40)],
             "length": 900, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": f"r{i}"}
            for i in range(n)]


def observe_app(tmp_path, *extra):
    from eval.observe.__main__ import run
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lb_rows()))
    return run(compose("observe", ["model=tiny-llama", f"observe.data=longbench:hotpotqa:{data}",
                                   "observe.window=16", "observe.prompt_windows=5", "observe.response_windows=3",
                                   "observe.min_prompt_tokens=100", "observe.min_response_tokens=48",
                                   f"output_dir={tmp_path}/run", *extra]))


def test_app_draws_figures_2_and_3_and_resumes(tmp_path):
    lines = observe_app(tmp_path, "observe.limit=2")
    assert [l["sample"] for l in lines] == ["r0", "r1"]
    records = lines[0]["records"]
    assert {(r["figure"], r["window"]) for r in records} == {(2, i) for i in range(5)} | {(3, j) for j in range(3)}
    assert {r["layer"] for r in records} == {0, 1, 2, 3} and all(len(r["heads"]) == 4 for r in records)
    assert all(v is None or 0 <= v <= 1 for r in records for v in r["heads"])
    run = tmp_path / "run"
    for name in ("hit_rates.md", "figure2_prompt_windows.png", "figure2_prompt_windows.pdf",
                 "figure3_response_windows.png"):
        assert (run / name).exists()
    assert "| layer | response window 1 | response window 2 | response window 3 |" in (run / "hit_rates.md").read_text()
    lines = observe_app(tmp_path)
    assert [l["sample"] for l in lines] == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="observe.theta"):
        observe_app(tmp_path, "observe.theta=2", "resume=restart")


def test_question_at_the_start_and_instruction_overlap(tmp_path):
    lines = observe_app(tmp_path, "observe.question_position=start", "observe.limit=1")
    assert len(lines) == 1
    lines = observe_app(tmp_path / "v", "observe.variant=instructions", "observe.limit=1")
    assert len(lines[0]["others"]) == 2 and len(lines[0]["layers"]) == 4
    assert all(0 <= v <= 1 for layer in lines[0]["layers"] for v in layer)
    assert "| layer | overlap |" in (tmp_path / "v" / "run" / "overlap.md").read_text()


def test_conversations_in_ultrachat_form(tmp_path, smol_tokenizer):
    from eval.observe.data import conversation_samples
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"id": "u1", "data": ["Hello there", "Hi!", "Tell me a story", "Once upon a time"]})
                    + "\n" + json.dumps({"messages": [{"role": "user", "content": "Q"},
                                                      {"role": "assistant", "content": "A"}]}) + "\n")
    samples = conversation_samples(path, smol_tokenizer)
    assert [s.id for s in samples] == ["u1", "2"] and samples[0].response == "Once upon a time"
    assert "Tell me a story" in smol_tokenizer.decode(samples[0].prompt_ids)
    assert "Once upon" not in smol_tokenizer.decode(samples[0].prompt_ids)
    path.write_text(json.dumps({"data": ["only the user"]}) + "\n")
    with pytest.raises(ValueError, match="chat.jsonl:1: the conversation must end with an assistant turn"):
        conversation_samples(path, smol_tokenizer)
