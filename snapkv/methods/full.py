"""Full KV: the uncompressed baseline (a no-op that still reports cache lengths)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..method import Method
from ..registry import register


@register
@dataclass
class FullKV(Method):
    method = "full"
    display_name = "FullKV"
    kvpress_entries = {"no_press": {}}  # the baseline
    reference = "the uncompressed baseline"
    budget_meaning = "everything is kept"
    tag_parts = ()
    budget: int | None = None
    window: int = 0

    def validate(self) -> None:
        for name in ("budget", "ratio"):
            if getattr(self, name) is not None:
                raise InputError(f"{name}={getattr(self, name)!r}: full KV keeps every token; "
                                 f"leave {name} unset (null)")

    @property
    def compresses(self) -> bool:
        return False
