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
    budgets = [cfg.layer_budget(i, 32) for i in range(32)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 1024 > budgets[-1]
    assert abs(sum(budgets) / 32 - 1024) < 0.05 * 1024  # integer steps, as in official PyramidKV


def test_streamingllm_window_is_derived():
    cfg = snapkv.StreamingLLMConfig(budget=100, sink_tokens=4)
    assert cfg.window == 96
    with pytest.raises(ValueError, match="sink_tokens"):
        snapkv.StreamingLLMConfig(budget=4, sink_tokens=4)
