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
