"""One way to save a figure: PNG and PDF side by side, reproducible (no dates in the metadata, so
the same runs give the same bytes and a committed report only changes when its numbers do)."""
from __future__ import annotations

from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METADATA = {".png": {"Software": None},
            ".pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": None}}


def save_figure(fig, path: Path, **savefig) -> list[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    outs = [path.with_suffix(".png"), path.with_suffix(".pdf")]
    for out in outs:
        fig.savefig(out, dpi=150, metadata=METADATA[out.suffix], **savefig)
    plt.close(fig)
    return outs


# Line styles that tell many lines apart: tab20's dark shades first, then its light ones, each line also
# with its own marker (and a dashed line from the eleventh on, where the light shades start).
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "*")
LINESTYLES = ("-", "--", "-.", ":")


def line_styles(names, rank=None) -> dict:
    """``{name: {"color", "marker", "linestyle"}}``: the names in order (``rank(name)`` first, then the
    name), each a distinct (colour, marker) pair (for up to 240 names), the same styles for the same names
    in every figure."""
    cmap = matplotlib.colormaps["tab20"]
    colours = [matplotlib.colors.to_hex(cmap(i)) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    ordered = sorted(set(names), key=lambda n: ((rank(n) if rank else 0), n))
    n = len(colours)  # the same colour again comes with the next marker
    return {name: {"color": colours[i % n], "marker": MARKERS[(i % n + i // n) % len(MARKERS)],
                   "linestyle": LINESTYLES[(i // 10) % len(LINESTYLES)]}
            for i, name in enumerate(ordered)}
