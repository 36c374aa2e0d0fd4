"""Bad compressor settings fail with a ValueError naming the field and what is allowed."""
import pytest

import snapkv
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
        snapkv.SnapKVConfig(**kwargs)


def test_pooling_error_lists_allowed_values():
    with pytest.raises(ValueError, match="maxpool, avgpool, none"):
        snapkv.SnapKVConfig(pooling="mean")


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
    cfg = snapkv.PyramidKVConfig(budget=1024, window=32)
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
    cfg = snapkv.PyramidKVConfig(budget=budget, window=window)
    assert [cfg.layer_budget(i, layers, prompt) for i in range(layers)] == \
        official_pyramidkv_capacity(layers, budget, window, prompt)


def test_pyramid_issue_example():
    cfg = snapkv.PyramidKVConfig(budget=48, window=8)
    assert [cfg.layer_budget(i, 3, 60) for i in range(3)] == [48, 48, 48]


def test_streamingllm_window_is_derived():
    cfg = snapkv.StreamingLLMConfig(budget=100, sink_tokens=4)
    assert cfg.window == 96
    with pytest.raises(ValueError, match="sink_tokens"):
        snapkv.StreamingLLMConfig(budget=4, sink_tokens=4)
