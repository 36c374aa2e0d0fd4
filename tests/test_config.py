"""Bad compressor settings fail with a ValueError naming the field and what is allowed."""
import pytest

import snapkv
from method_settings import COMPRESSING
from snapkv import build_config


@pytest.mark.parametrize("kwargs,field", [
    (dict(budget=32, window=32), "budget"),
    (dict(budget=16, window=32), "budget"),
    (dict(kernel=4), "kernel"),
    (dict(kernel=0), "kernel"),
    (dict(pooling="minpool"), "pooling"),
    (dict(gqa="sum"), "gqa"),
    (dict(window=0), "window"),
    (dict(budget=1.5), "budget"),
])
def test_snapkv_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        snapkv.SnapKV(**kwargs)


def test_pooling_error_lists_allowed_values():
    with pytest.raises(ValueError, match="maxpool, avgpool, none"):
        snapkv.SnapKV(pooling="mean")


def test_build_config_unknown_method_and_field():
    with pytest.raises(ValueError, match="compressor.method.*snapkv"):
        build_config("snapkv2", budget=64)
    with pytest.raises(ValueError, match="compressor.capacity"):
        build_config("snapkv", capacity=64)


def test_build_config_drops_shared_fields_a_method_does_not_use():
    cfg = build_config("h2o", budget=256, window=16, kernel=7, pooling="maxpool", gqa="mean")
    assert (cfg.method, cfg.budget, cfg.window) == ("h2o", 256, 16)
    assert build_config("full", budget=None, window=32, kernel=7).compresses is False
    with pytest.raises(ValueError, match="budget"):
        build_config("full", budget=1024)


def test_pyramid_budgets_decrease_and_average_to_budget():
    cfg = snapkv.PyramidKV(budget=1024, window=32)
    budgets = [cfg.layer_budget(i, 32, 16384) for i in range(32)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 1024 > budgets[-1]
    assert abs(sum(budgets) / 32 - 1024) < 0.05 * 1024  # integer steps, as in official PyramidKV


def official_pyramidkv_capacity(layers, budget, window, prompt, beta=20):
    """Tokens one layer keeps, transcribed from KVCache-Factory pyramidkv/pyramidkv_utils.py
    PyramidKVCluster.update_kv (its branches and integer arithmetic, per layer_idx)."""
    kept = []
    for layer_idx in range(layers):
        min_num = (budget - window) // beta
        max_num = (budget - window) * 2 - min_num
        if max_num >= prompt - window:
            max_num = prompt - window
            min_num = (budget - window) * 2 - max_num
        steps = (max_num - min_num) // (layers - 1)
        max_capacity_prompt = max_num - layer_idx * steps
        if prompt < budget:
            kept.append(prompt)                       # returns key_states unchanged
        elif prompt < (budget - window) * 2:
            kept.append(budget - window + window)     # topk(budget - window) + the window
        else:
            kept.append(max_capacity_prompt + window)
    return kept


# (layers, budget, window, prompt) around each branch threshold: prompt vs budget, vs 2 * (budget -
# window), and the clamp of max to prompt - window; 3 and 32 layers.
PYRAMID_CASES = [(3, 48, 8, 60), (3, 48, 8, 47), (3, 48, 8, 48), (3, 48, 8, 79), (3, 48, 8, 80), (3, 48, 8, 81),
                 (3, 48, 8, 85), (3, 48, 8, 86), (3, 48, 8, 87), (3, 48, 8, 150), (3, 48, 8, 1000),
                 (32, 1024, 32, 1000), (32, 1024, 32, 1024), (32, 1024, 32, 1983), (32, 1024, 32, 1984),
                 (32, 1024, 32, 2000), (32, 1024, 32, 2015), (32, 1024, 32, 2016), (32, 1024, 32, 2017),
                 (32, 1024, 32, 2100), (32, 1024, 32, 16384), (32, 2048, 64, 4000), (32, 128, 32, 200)]


@pytest.mark.parametrize("layers,budget,window,prompt", PYRAMID_CASES)
def test_pyramid_budgets_equal_the_official_schedule(layers, budget, window, prompt):
    cfg = snapkv.PyramidKV(budget=budget, window=window)
    assert [cfg.layer_budget(i, layers, prompt) for i in range(layers)] == \
        official_pyramidkv_capacity(layers, budget, window, prompt)


def test_pyramid_issue_example():
    cfg = snapkv.PyramidKV(budget=48, window=8)
    assert [cfg.layer_budget(i, 3, 60) for i in range(3)] == [48, 48, 48]


def test_streamingllm_window_is_derived():
    cfg = snapkv.StreamingLLM(budget=100, sink_tokens=4)
    assert cfg.window == 96
    with pytest.raises(ValueError, match="sink_tokens"):
        snapkv.StreamingLLM(budget=4, sink_tokens=4)


# -- budgets as a fraction (compressor.ratio, kvpress's compression_ratio) ---------------------------
@pytest.mark.parametrize("method", COMPRESSING)
def test_a_ratio_keeps_the_fraction_kvpress_keeps(method):
    cfg = snapkv.build_config(method, budget=None, ratio=0.75)
    if "ratio" in cfg.derived:  # keeps every token (ThinK drops key channels): kvpress's evaluate sets no ratio
        assert cfg.ratio == 0 and cfg.budget_for(1000) == 1000 and "ratio 0.75" not in cfg.label()
        return
    assert cfg.budget_for(1000) == 250 and cfg.budget_for(4097) == int(4097 * 0.25)
    assert cfg.label().split(" ")[1:3] == ["ratio", "0.75"]
    if method == "chunkkv":  # whole chunks of 20, as kvpress's ChunkKVPress: int(50 * 0.25) of 50
        assert [cfg.layer_budget(i, 4, 1000) for i in range(4)] == [12 * 20] * 4
    elif method != "pyramidkv":  # KVzip cuts after the prefill: its layers are whole until then
        if cfg.scores_after_prefill:
            assert [cfg.stored_tokens(i, 4, 1000, 8) for i in range(4)] == [250] * 4
        else:
            assert [cfg.layer_budget(i, 4, 1000) for i in range(4)] == [250] * 4
    if cfg.head_adaptive or cfg.recent_window(0, 4, 10) == 0:  # kvpress's compute_n_kept: at least 1
        assert cfg.budget_for(1) == 1 and cfg.budget_for(10) == 2
    else:  # never fewer than the tokens always kept and one more
        assert cfg.budget_for(10) == cfg.recent_window(0, 4, 10) + (cfg.sink_tokens if method == "streamingllm" else 1)


def test_pyramidkv_with_a_ratio_is_pyramidkv_at_that_prompts_budget():
    by_ratio = snapkv.PyramidKV(budget=None, ratio=0.75)
    by_budget = snapkv.PyramidKV(budget=4000)
    assert [by_ratio.layer_budget(i, 32, 16000) for i in range(32)] == \
        [by_budget.layer_budget(i, 32, 16000) for i in range(32)]


@pytest.mark.parametrize("values, message", [
    (dict(budget=1024, ratio=0.5), "set exactly one of the two"),
    (dict(budget=None, ratio=1.0), r"ratio=1.0 must be a number in \[0, 1\)"),
    (dict(budget=None, ratio="half"), "ratio='half' must be a number"),
    (dict(budget=None, ratio=None), "budget=None must be an integer"),
])
def test_budget_and_ratio_are_one_or_the_other(values, message):
    with pytest.raises(snapkv.InputError, match=message):
        snapkv.SnapKV(**values)
    with pytest.raises(snapkv.InputError, match="ratio=0.5: full KV keeps every token"):
        snapkv.FullKV(ratio=0.5)


def test_a_ratio_on_the_command_line_replaces_the_default_budget():
    from conftest import compose
    cfg = compose("longbench", ["compressor.ratio=0.5"])
    assert cfg.compressor.budget is None and cfg.compressor.tag == "snapkv-r0.5-w32-k7-maxpool-mean"
    assert compose("longbench", ["compressor=streamingllm", "compressor.ratio=0.25"]).compressor.tag == \
        "streamingllm-r0.25-s4"
    both = compose("longbench", ["compressor.ratio=0.5", "compressor.budget=2048"])
    from eval.hydra_app import make_compressor
    with pytest.raises(snapkv.InputError, match="budget=2048 and ratio=0.5: set exactly one"):
        make_compressor(both.compressor)
