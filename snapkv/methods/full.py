"""Full KV: the uncompressed baseline (a no-op that still reports cache lengths)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import CompressorConfig, InputError, register


@register
@dataclass
class FullConfig(CompressorConfig):
    method = "full"
    display_name = "FullKV"
    budget: int | None = None
    window: int = 0

    def validate(self) -> None:
        for name in ("budget", "ratio"):
            if getattr(self, name) is not None:
                raise InputError(f"{name}={getattr(self, name)!r}: full KV keeps every token; leave {name} unset (null)")

    @property
    def compresses(self) -> bool:
        return False
