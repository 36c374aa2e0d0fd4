"""The parity tests' tolerance at ties (``tests/parity.py``): a (layer, head) pair that keeps another position than
the reference passes only when rounding could move both positions' scores, as we compute them, to the cut
(``Method.ranking_bounds``); a real difference still fails. On constructed scores; end to end on a tiny model whose
first layer ties by construction (the same token's keys have one norm, whatever RoPE rotates them by); and on
LagKV's ranks, which move together where raw scores of one partition tie."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import snapkv
from snapkv.cache_state import RankedScores
from parity import TIES, compare_kept, tie_reason
from snapkv.method import TIE_TOLERANCE
from tiny_models import tiny_model


def kept(*positions, length=8) -> np.ndarray:
    mask = np.zeros(length, dtype=bool)
    mask[list(positions)] = True
    return mask


SCORES = np.array([0.9, 0.5, 0.5 * (1 + TIE_TOLERANCE / 4), 0.2, 0.8, 0.5 * (1 - 2 * TIE_TOLERANCE), 0.1, 1.0])


def bounded(scores):
    """``(scores, low, high)`` by ``Method.ranking_bounds``' default."""
    low, high = snapkv.Method.ranking_bounds(None, None, torch.tensor(scores), TIE_TOLERANCE)
    return scores, low.numpy(), high.numpy()


def test_a_swap_between_positions_tied_at_the_cut_passes():
    assert tie_reason(kept(0, 1, 4, 7), kept(0, 2, 4, 7), bounded(SCORES)) is None


def test_a_swap_with_a_position_beyond_the_tolerance_fails():
    assert "positions [5]" in tie_reason(kept(0, 1, 4, 7), kept(0, 5, 4, 7), bounded(SCORES))
    assert "positions [3]" in tie_reason(kept(0, 1, 4, 7), kept(0, 3, 4, 7), bounded(SCORES))


def test_another_count_or_no_scores_fails():
    assert "keeps 4 positions, the reference 5" in tie_reason(kept(0, 1, 4, 7), kept(0, 1, 2, 4, 7),
                                                              bounded(SCORES))
    assert "no per-head scores" in tie_reason(kept(0, 1, 4, 7), kept(0, 2, 4, 7), None)


def test_lagkv_ranks_reach_the_ranks_of_raw_scores_tied_within_their_partition():
    """Partition [0.3, 0.1, 0.1 + a rounding, 0.7]: the two tied positions may swap ranks 0 and 1, the others not;
    a raw score in another partition never widens this one's bounds."""
    from snapkv.methods.lagkv import rank_bounds
    raw = torch.tensor([[[[0.3, 0.1, 0.1 * (1 + TIE_TOLERANCE / 2), 0.7], [0.1, 0.2, 0.3, 0.4]]]])
    below, above = rank_bounds(raw, TIE_TOLERANCE)
    assert below[0, 0].tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert above[0, 0].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]


def test_compare_kept_counts_exact_pairs_ties_and_failures():
    want = np.stack([kept(0, 2, 4, 7), kept(0, 1, 4, 7), kept(0, 5, 4, 7)])[None]
    got = np.stack([kept(0, 1, 4, 7)] * 3)[None]
    scores = torch.tensor(np.stack([SCORES] * 3))[None]
    low, high = snapkv.Method.ranking_bounds(None, None, scores, TIE_TOLERANCE)
    result = compare_kept(got, want, [RankedScores(scores, low, high)], label="constructed")
    assert (result.pairs, result.exact, result.ties) == (3, 1, [(0, 0)])
    assert [pair[:2] for pair in result.differing] == [(0, 2)] and not result.equal
    assert "1 of 3 (layer, head) pairs differ beyond a tie (1 at a tie)" in result.describe("constructed")
    assert TIES.pop("constructed") == [(0, 0)]


def test_layer_zero_of_a_repeated_token_ties_and_a_swap_there_passes_while_one_elsewhere_fails():
    """Knorm at layer 0 scores each key's norm: a token repeated through the prompt has one key, rotated by RoPE to
    each position, so its copies tie to the last bits, and any of them may be kept on another machine."""
    model = tiny_model("llama-gqa", seed=3)
    torch.manual_seed(0)
    ids = torch.randint(5, 120, (1, 48))
    ids[0, ::3] = 4  # every third position is the same token
    with torch.no_grad(), snapkv.compress(model, snapkv.Knorm(budget=None, ratio=0.5), record_scores=True) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        cache = session.caches[0]
    scores = snapkv.ranking_scores(cache)
    assert all(layer is not None for layer in scores)
    got = np.zeros((len(scores), scores[0].scores.shape[1], ids.shape[1]), dtype=bool)
    for layer, rows in enumerate(snapkv.kept_positions(cache)):
        for head, positions in enumerate(rows[0]):
            got[layer, head, positions.numpy()] = True
    copies = np.flatnonzero(ids[0].numpy() == 4)
    head = 0
    kept_copies = [p for p in copies if got[0, head, p]]
    dropped_copies = [p for p in copies if not got[0, head, p]]
    assert kept_copies and dropped_copies, "the repeated token straddles the cut of layer 0, head 0"
    layer0 = scores[0].scores[0, head].numpy()
    assert np.ptp(layer0[copies]) <= TIE_TOLERANCE * abs(layer0[copies]).max()  # its copies tie

    swapped = got.copy()  # the reference kept another copy of the same token: a tie
    swapped[0, head, kept_copies[0]], swapped[0, head, dropped_copies[0]] = False, True
    result = compare_kept(got, swapped, scores, label="layer-0 tie")
    assert result.equal and result.ties == [(0, head)]
    assert TIES.pop("layer-0 tie") == [(0, head)]

    other = [p for p in range(ids.shape[1]) if not got[0, head, p] and ids[0, p] != 4][0]
    moved = got.copy()  # the reference kept another token instead: a real difference
    moved[0, head, kept_copies[0]], moved[0, head, other] = False, True
    assert not compare_kept(got, moved, scores).equal


def recorded(cfg, seed=3, length=300):
    model = tiny_model("llama-gqa", seed=seed)
    ids = torch.randint(5, 120, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), snapkv.compress(model, cfg, record_scores=True) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        return snapkv.ranking_scores(session.caches[0])


def test_compactor_bounds_are_its_measured_spread_and_adakv_takes_its_scorers():
    """Compactor's scores (z-scores, a Cholesky solve) move under one rounding of the inputs by more than the default
    tolerance: its bounds are measured, never narrower than the default; AdaKV over it ranks across heads with them."""
    plain = recorded(snapkv.Compactor(budget=None, ratio=0.5))
    for layer in plain:
        assert bool((layer.low <= layer.scores).all() and (layer.scores <= layer.high).all())
        default = TIE_TOLERANCE * layer.scores.abs()
        assert bool(((layer.high - layer.scores) >= default / 2).all())  # halved: (s + d) - s rounds in float32
        assert not layer.across_heads
    assert any(bool(((layer.high - layer.scores) > 10 * TIE_TOLERANCE * layer.scores.abs()).any()) for layer in plain)
    ada = recorded(snapkv.AdaKV(budget=None, ratio=0.5, scorer="compactor"))
    assert all(layer.across_heads for layer in ada)
    assert any(bool(((layer.high - layer.scores) > 10 * TIE_TOLERANCE * layer.scores.abs()).any()) for layer in ada)


def test_no_scores_are_recorded_unless_asked_or_for_a_cut_of_no_per_head_ranking():
    model = tiny_model("llama-gqa", seed=3)
    ids = torch.randint(5, 120, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), snapkv.compress(model, [snapkv.SnapKV(budget=64, window=8),
                                                  snapkv.ChunkKV(budget=None, ratio=0.5)]) as session:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
        assert snapkv.ranking_scores(session.caches[0]) == [None] * 3
    chunked = recorded(snapkv.ChunkKV(budget=None, ratio=0.5))
    assert chunked == [None] * 3


def test_a_position_held_at_the_end_passes_only_if_one_of_our_cuts_while_decoding_met_it_at_a_tie():
    from parity import compare_held
    scores = torch.tensor([[[0.9, 0.5, 0.5 * (1 + TIE_TOLERANCE / 4), 0.2, 0.8, 0.1]]])
    low, high = snapkv.Method.ranking_bounds(None, None, scores, TIE_TOLERANCE)
    cut_kept = torch.zeros(scores.shape, dtype=torch.bool)
    cut_kept[0, 0, [0, 2, 4]] = True
    cut = RankedScores(scores, low, high, False, torch.arange(6)[None, None], cut_kept)
    got = np.zeros((1, 1, 8), dtype=bool)
    got[0, 0, [0, 2, 4, 6, 7]] = True
    tied, far, fewer = got.copy(), got.copy(), got.copy()
    tied[0, 0, [1, 2]] = True, False   # the reference kept the other position of the tie
    far[0, 0, [3, 2]] = True, False    # ... or one far below the cut
    fewer[0, 0, 2] = False
    assert compare_held(got, tied, [[cut]], label="decoding tie").ties == [(0, 0)]
    assert TIES.pop("decoding tie") == [(0, 0)]
    assert "positions [3] were at no tie of our 1 cuts" in compare_held(got, far, [[cut]]).differing[0][2]
    assert "holds 5 positions, the reference 4" in compare_held(got, fewer, [[cut]]).differing[0][2]
    assert not compare_held(got, tied, [[]]).equal  # no cut recorded: nothing can be a tie


def test_a_head_adaptive_cut_may_trade_a_position_between_heads_only_at_a_tie():
    """One cut over the layer's heads: head 0 keeping one position more and head 1 one less passes when both sit at
    the layer's cut; the same trade with a position far below it fails, and so does a layer keeping more."""
    scores = torch.tensor([[[0.9, 0.5 * (1 + TIE_TOLERANCE / 4), 0.1, 0.8], [0.7, 0.5, 0.2, 0.6]]])
    low, high = snapkv.Method.ranking_bounds(None, None, scores, TIE_TOLERANCE)
    layer = [RankedScores(scores, low, high, True)]
    got = np.array([[[True, True, False, True], [True, False, False, True]]])  # the top 5 of the layer
    traded, far, more = got.copy(), got.copy(), got.copy()
    traded[0, 0, 1], traded[0, 1, 1] = False, True
    far[0, 0, 1], far[0, 1, 2] = False, True
    more[0, 1, 1] = True
    result = compare_kept(got, traded, layer, label="across heads")
    assert result.ties == [(0, 0), (0, 1)] and result.equal
    assert TIES.pop("across heads") == [(0, 0), (0, 1)]
    assert not compare_kept(got, far, layer).equal
    assert "keeps 6 positions, the reference 5" in compare_kept(more, got, layer).differing[0][2]


def test_lagkv_records_rank_bounds_that_reach_its_ties_and_nothing_else():
    """End to end on a tiny model: a rank's bounds are whole ranks (``rank / lag_size``), the sinks and the tail 1."""
    lagkv = snapkv.build_config("lagkv", budget=None, ratio=0.5, lag_size=16, n_sink=4)
    for layer in recorded(lagkv, length=100):
        steps = torch.cat([(layer.scores - layer.low), (layer.high - layer.scores)]) * 16
        assert torch.allclose(steps, steps.round(), atol=1e-4) and bool((steps >= 0).all())
        assert bool((layer.scores[..., :4] == 1).all() and (layer.low[..., :4] == 1).all())


def test_record_scores_takes_true_false_or_a_tolerance():
    model = tiny_model("llama-gqa", seed=3)
    for wrong in (-1, 1, 2.5, "yes"):
        with pytest.raises(snapkv.InputError, match="record_scores="):
            with snapkv.compress(model, snapkv.Knorm(budget=8), record_scores=wrong):
                pass
