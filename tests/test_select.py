"""select_positions equals the official SnapKV update_kv selection, step by step."""
import math

import pytest
import torch
import torch.nn.functional as F

from snapkv import SnapKV, select_positions


def official_selection(queries, keys, budget, window, kernel, pooling):
    """The official SnapKVCluster.update_kv steps, on KV repeated to every query head."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    head_dim = queries.shape[-1]
    weights = torch.matmul(queries[..., -window:, :], keys.transpose(2, 3)) / math.sqrt(head_dim)
    mask = torch.full((window, window), torch.finfo(weights.dtype).min, device=weights.device)
    cond = torch.arange(mask.size(-1))
    mask.masked_fill_(cond < (cond + 1).view(mask.size(-1), 1), 0)
    weights[:, :, -window:, -window:] += mask[None, None]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(queries.dtype)
    summed = weights[:, :, -window:, :-window].sum(dim=-2)
    if pooling == "avgpool":
        pooled = F.avg_pool1d(summed, kernel_size=kernel, padding=kernel // 2, stride=1)
    else:
        pooled = F.max_pool1d(summed, kernel_size=kernel, padding=kernel // 2, stride=1)
    return pooled.topk(budget - window, dim=-1).indices


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("pooling", ["maxpool", "avgpool"])
@pytest.mark.parametrize("kernel,window,budget", [(7, 32, 96), (5, 16, 40), (1, 8, 200), (3, 1, 17)])
def test_matches_official_update_kv(heads, kv_heads, pooling, kernel, window, budget):
    torch.manual_seed(heads * 1000 + kernel * 10 + window)
    b, length, d = 2, 257, 16
    queries = torch.randn(b, heads, length, d) * 2
    keys = torch.randn(b, kv_heads, length, d) * 2
    cfg = SnapKV(budget=budget, window=window, kernel=kernel, pooling=pooling, gqa="repeat")
    ours = select_positions(queries, keys, cfg)
    ref = official_selection(queries, keys, budget, window, kernel, pooling).sort(dim=-1).values
    assert ours.shape == (b, heads, budget - window)
    assert ours.dtype == torch.long
    assert torch.equal(ours, ref)
    assert bool((ours[..., 1:] > ours[..., :-1]).all()), "sorted ascending, no duplicates"
    assert int(ours.max()) < length - window


def test_window_only_queries_accepted():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 300, 8), torch.randn(1, 2, 300, 8)
    cfg = SnapKV(budget=64, window=16, kernel=7, gqa="repeat")
    assert torch.equal(select_positions(q, k, cfg), select_positions(q[:, :, -16:], k, cfg))


@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_gqa_aggregates_official_scores_per_kv_group(gqa):
    torch.manual_seed(1)
    q, k = torch.randn(2, 8, 120, 8), torch.randn(2, 2, 120, 8)
    cfg = SnapKV(budget=40, window=8, kernel=5, gqa=gqa)
    idx = select_positions(q, k, cfg)
    assert idx.shape == (2, 2, 32)
    # a KV group's query heads vote; with mean the vote is their average pooled score
    from snapkv.select import pool, window_attention
    per_head = pool(window_attention(q, k, 8), "maxpool", 5).reshape(2, 2, 4, -1)
    combined = per_head.mean(2) if gqa == "mean" else per_head.amax(2)
    assert torch.equal(idx, combined.topk(32, dim=-1).indices.sort(-1).values)


def test_pooling_none_is_plain_topk():
    torch.manual_seed(2)
    q, k = torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    cfg = SnapKV(budget=30, window=10, kernel=5, pooling="none")
    from snapkv.select import window_attention
    expected = window_attention(q, k, 10).topk(20, dim=-1).indices.sort(-1).values
    assert torch.equal(select_positions(q, k, cfg), expected)


def test_padded_positions_never_selected():
    torch.manual_seed(3)
    q, k = torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    pad = torch.ones(1, 100, dtype=torch.bool)
    pad[:, :30] = False
    idx = select_positions(q, k, SnapKV(budget=40, window=8, kernel=3), pad_mask=pad)
    assert int(idx.min()) >= 30


def test_sequence_shorter_than_budget_is_an_error():
    with pytest.raises(ValueError, match="budget"):
        select_positions(torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8), SnapKV(budget=64, window=8))


def test_select_positions_takes_a_ratio_as_the_prompts_budget():
    import torch
    import snapkv
    queries, keys = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 100, 8)
    by_ratio = snapkv.select_positions(queries, keys, snapkv.SnapKV(budget=None, ratio=0.6, window=16, kernel=3))
    by_budget = snapkv.select_positions(queries, keys, snapkv.SnapKV(budget=40, window=16, kernel=3))
    assert torch.equal(by_ratio, by_budget)


def test_the_api_contract_example_runs_as_written():
    """DESIGN.md 3.1: ``from snapkv import SnapKVConfig, select_positions`` and its call; kept positions
    [batch, heads, budget - window] in [0, L - window), ascending; bad values a ValueError naming the field."""
    from snapkv import SnapKVConfig, select_positions as contract_select
    cfg = SnapKVConfig(budget=64, window=16, kernel=7, pooling="maxpool", gqa="mean")
    queries, keys = torch.randn(1, 8, 16, 32), torch.randn(1, 2, 200, 32)
    idx = contract_select(queries, keys, cfg)
    assert idx.shape == (1, 2, 48) and idx.dtype == torch.long
    assert int(idx.min()) >= 0 and int(idx.max()) < 200 - 16
    assert torch.equal(idx, idx.sort(dim=-1).values)
    with pytest.raises(ValueError, match="kernel"):
        SnapKVConfig(budget=64, window=16, kernel=4)
