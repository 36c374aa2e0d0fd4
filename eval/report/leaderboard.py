"""The kvpress leaderboard's table and figures from RULER runs made with ``compressor.ratio`` (the preset
``experiment=kvpress_leaderboard``): per model, length and question placement, one row a method, one
column a compression ratio, the RULER average in each cell; ratio 0 is full KV, where every method's
line starts (as the leaderboard draws it). Runs given a budget in tokens are not leaderboard points. A method
whose size is another field sits at that field (``Method.board_size``: DuoAttention's ``head_ratio``, as kvpress's
``evaluate.py`` gives that press the board's ratio).
Where the runs recorded their cost, a second table gives each (method, ratio)'s KV memory, compression
overhead and decoding speed, and two more figures draw the score against memory and compression time.
Rows and lines carry kvpress's names (its registry's), our label beside where it differs."""
from __future__ import annotations

import csv
import dataclasses
import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from .. import leaderboard as protocol
from ..plotting import line_styles, save_figure
from .collect import COST_COLUMNS, COST_FIELDS, COST_NOTE, cost_cells, cost_fields, label_of

FULL = f"{protocol.KVPRESS_NAMES['full']} (FullKV)"
PARTIAL = "_partial"  # a board's (method, ratio) cells averaged over fewer than RULER's 13 tasks
COSTS = "_costs"  # a board's {(method, ratio): cost} (collect.cost_summary) where the runs recorded one
_RANK = {name: i for i, name in enumerate(protocol.KVPRESS_NAMES.values())}


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def kvpress_entry(compressor: dict) -> str | None:
    """The entry of ``eval.leaderboard.ALL_ENTRIES`` a run's compressor is (``"full"`` for full KV), matched by
    its method and the entry's own fields (``scorer``, ``scorer_epsilon``); a field that another entry of
    the same method sets must keep its default. None when it matches no entry."""
    import snapkv
    method = compressor.get("method")
    if method == "full":
        return "full"
    try:
        cfg = snapkv.build_config(method, **{k: v for k, v in compressor.items() if k not in ("method", "tag")})
    except (ValueError, TypeError):
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    entries = {name: {k: v for k, v in extra.items() if k != "method"}
               for name, extra in protocol.ALL_ENTRIES.items() if extra.get("method", name) == method}
    keys = {k for extra in entries.values() for k in extra}
    for name, extra in entries.items():
        if all(_same(getattr(cfg, k, None), extra.get(k, defaults.get(k))) for k in keys):
            return name
    return None


def board_ratio(compressor: dict) -> float | None:
    """The compression ratio the leaderboard places a run at: the field its method names (``Method.board_size``:
    ``ratio``, DuoAttention's ``head_ratio``); None for a run given a budget in tokens."""
    value = compressor.get(_board_field(compressor))
    return None if value is None else float(value)


def _board_field(compressor: dict) -> str:
    from snapkv.registry import METHODS
    method = METHODS.get(compressor.get("method"))
    return method.board_size if method is not None else "ratio"


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def method_name(compressor: dict) -> str:
    """A run's setting without its size, under kvpress's name: ``snapkv (SnapKV, window 64, kernel 5,
    pooling avgpool)``, ``knorm``, ``expected_attention (AdaKV, scorer expected_attention, scorer_epsilon
    0.01)``; our label alone (``SnapKV (window 16)``) for a run that is no entry of the leaderboard."""
    ours = label_of(compressor)
    size = board_ratio(compressor)
    if size is not None:  # the label's size (``ratio 0.5``, DuoAttention's ``head_ratio 0.5``)
        ours = ours.replace(f" {_board_field(compressor)} {size:g}", "", 1)
    entry = kvpress_entry(compressor)
    if entry is None:
        return ours
    press = protocol.KVPRESS_NAMES[entry]
    if _plain(ours) == _plain(press):
        return press
    name, _, fields = ours.partition(" (")
    return f"{press} ({name}{', ' + fields[:-1] if fields else ''})"


def _rank(name: str) -> int:
    """Leaderboard entries in ``KVPRESS_NAMES``'s order, other settings after them (for line styles)."""
    return _RANK.get(name.split(" ")[0], len(_RANK))


def leaderboard_points(runs: list[dict]) -> dict:
    """``{(model, length, query_aware): {method: {ratio: average}}}``; full KV is ratio 0 of ``FULL``.
    A board's ``PARTIAL`` holds its (method, ratio) averaged over fewer than 13 tasks, its ``COSTS`` the
    cost of each (method, ratio) that recorded one."""
    boards: dict = {}
    for r in runs:
        compressor = r.get("compressor") or {}
        ratio = 0.0 if r["method"] == "full" else board_ratio(compressor)
        if ratio is None:
            continue
        name = FULL if r["method"] == "full" else method_name(compressor)
        model = r["model"] + (f" · {r['decoding']}" if r.get("decoding") else "")  # speculative runs: a board each
        for length, one in r["by_length"].items():
            key = (model, int(length), r.get("query_aware", True))
            boards.setdefault(key, {}).setdefault(name, {})[float(ratio)] = one["average"]
            if not one.get("complete", True):
                boards[key].setdefault(PARTIAL, set()).add((name, float(ratio)))
            cost = (r.get("cost_by_length") or {}).get(length)
            if cost:
                boards[key].setdefault(COSTS, {})[(name, float(ratio))] = cost
    return boards


def _title(model: str, length: int, query_aware: bool) -> str:
    placement = "query-aware" if query_aware else "query-agnostic"
    return f"{model}, RULER {length} tokens, {placement}"


def write_leaderboard(runs: list[dict], out: Path) -> list[Path]:
    boards = {key: board for key, board in leaderboard_points(runs).items()
              if any(name not in (FULL, PARTIAL, COSTS) for name in board)}
    if not boards:
        return []
    md = ["# KV-cache compression leaderboard (kvpress's protocol)", "",
          "RULER average (13 tasks unless fewer ran) by compression ratio (`compressor.ratio`: the share of the",
          "prompt's KV removed); ratio 0 is full KV. Methods ranked by their average over the ratios run, named",
          "as kvpress's registry names them, our label beside where it differs.", ""]
    rows, written = [], []
    for (model, length, query_aware), board in sorted(boards.items()):
        partial = board.pop(PARTIAL, set())
        costs = board.pop(COSTS, {})
        ratios = sorted({x for points in board.values() for x in points} | {0.0})
        full = board.get(FULL, {}).get(0.0)
        md += [f"## {_title(model, length, query_aware)}", "",
               "| method | " + " | ".join(f"{x:g}" for x in ratios) + " | average |",
               "|---|" + "---|" * (len(ratios) + 1)]
        methods = [name for name in board if name != FULL]
        ranked = sorted(methods, key=lambda n: -_mean([v for x, v in board[n].items() if x > 0]))
        order = ([FULL] if full is not None else []) + ranked
        for name in order:
            points = dict(board[name])
            if name != FULL and full is not None:
                points.setdefault(0.0, full)
            compressed = [v for x, v in points.items() if x > 0]
            cells = ["–" if points.get(x) is None else
                     f"{points[x]:.2f}" + ("*" if (FULL if x == 0 else name, x) in partial else "") for x in ratios]
            average = f"{_mean(compressed):.2f}" if compressed else "–"
            md.append(f"| {name} | " + " | ".join(cells) + f" | {average} |")
            rows += [{"model": model, "length": length, "query_aware": query_aware, "method": name, "ratio": x,
                      "ruler_average": v, **cost_fields(costs.get((FULL if x == 0 else name, x)))}
                     for x, v in sorted(points.items())]
        if partial:
            md += ["", "\\* averaged over fewer than RULER's 13 tasks (see ruler.md for which)."]
        md.append("")
        if costs:
            md += _cost_table(board, order, costs)
        styles = line_styles([n for n in board if n != FULL], _rank)
        written += _figure(board, full, out, model, length, query_aware, styles)
        written += _cost_figures(board, full, costs, out, model, length, query_aware, styles)
    (out / "leaderboard.md").write_text("\n".join(md), encoding="utf-8")
    with open(out / "leaderboard.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "length", "query_aware", "method", "ratio", "ruler_average",
                                               *COST_FIELDS])
        writer.writeheader()
        writer.writerows(rows)
    return [out / "leaderboard.md", out / "leaderboard.csv", *written]


def _cost_table(board: dict, order: list[str], costs: dict) -> list[str]:
    """Per (method, ratio), the mean over the items run: KV cache bytes right after the prefill and their
    share of full KV's (kvpress's masked cache beside them where the method masks there), compression
    time over prefill time, decoding ms per token; blank where a run recorded no cost."""
    md = ["Cost per item (mean over the items run): " + COST_NOTE, "",
          "| method | ratio | " + " | ".join(COST_COLUMNS) + " |", "|---|---|" + "---|" * len(COST_COLUMNS)]
    for name in order:
        for x in sorted(board[name]):
            md.append(f"| {name} | {x:g} | " + " | ".join(cost_cells(costs.get((name, x)))) + " |")
    return md + [""]


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats (as little x and as much y, one of them strictly), by x."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def _cost_figures(board: dict, full, costs: dict, out: Path, model: str, length: int, query_aware: bool,
                  styles: dict) -> list[Path]:
    """RULER average against KV memory per item (the Pareto front marked) and against compression
    overhead, one line a method, full KV a star; none when no run recorded its cost."""
    if not costs:
        return []
    paths = []
    for kind, key, xlabel in (("memory", "kv_mib", "KV cache per item after the prefill (MiB)"),
                              ("time", "compress_overhead", "compression time / prefill time")):
        fig, ax = plt.subplots(figsize=(7.6, 4.4))
        every = []
        for name in sorted(styles, key=lambda n: (_rank(n), n)):
            xy = sorted((costs[(name, x)][key], v) for x, v in board[name].items()
                        if (name, x) in costs and costs[(name, x)].get(key) is not None and v is not None)
            if xy:
                ax.plot([p[0] for p in xy], [p[1] for p in xy], label=name, **styles[name])
                every += xy
        base = costs.get((FULL, 0.0), {}).get(key)
        if full is not None and base is not None:
            ax.plot([base], [full], linestyle="none", marker="*", markersize=11, color="black", label=FULL)
            every.append((base, full))
        if kind == "memory" and every:
            front = _pareto(every)
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="0.5", linewidth=0.8,
                    zorder=0, label="Pareto front")
            ax.scatter([p[0] for p in front], [p[1] for p in front], s=140, facecolors="none", edgecolors="0.3",
                       linewidths=1.0, zorder=3)
        if kind == "time":
            ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("RULER average")
        ax.set_title(_title(model, length, query_aware), fontsize=9)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        paths += save_figure(fig, out / f"{_stem(model, length, query_aware)}_{kind}.png", bbox_inches="tight")
    return paths


def _stem(model: str, length: int, query_aware: bool) -> str:
    placement = "aware" if query_aware else "agnostic"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model)
    return f"leaderboard_{safe}_{length}_{placement}"


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _figure(board: dict, full, out: Path, model: str, length: int, query_aware: bool,
            styles: dict) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7.6, 4.4))
    for name in sorted(styles, key=lambda n: (_rank(n), n)):
        points = dict(board[name])
        if full is not None:
            points.setdefault(0.0, full)
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], label=name, **styles[name])
    if full is not None:
        ax.axhline(full, linestyle="--", color="black", linewidth=1, label=FULL)
    ax.set_xlabel("compression ratio")
    ax.set_ylabel("RULER average")
    ax.set_title(_title(model, length, query_aware), fontsize=9)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return save_figure(fig, out / f"{_stem(model, length, query_aware)}.png", bbox_inches="tight")
