"""Items in flight (``batch.items``): which pending items of a prediction task are prefilled and decoded
together, and how many at once.

A step of greedy decoding reads every weight once whatever the batch, so several prompts decode for
about the cost of one. The engine reads a window of pending items at a time (``WINDOW`` x the batch
size), groups those that share their generation (answer length, stop tokens, question part), sorts a
group by length (longest first, so the padding of a left-padded batch is small) and cuts it into
batches: ``batch.items=N`` items each, or with ``auto`` as many as the memory planner fits for the
batch's longest prompt (``snapkv.memory.plan_shared`` with every setting of the job, the answer length,
``AutoSize.peak_above_weights``) in the memory at hand less ``batch.margin``: the device's free memory
after the model loaded, on a CPU ``batch.memory_gib`` (default: the available RAM). ``batch.max_items``
caps ``auto``. ``batch.prefill``: "each" prefills a batch's items one after another and decodes their
caches together; "padded" prefills them as one left-padded batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from snapkv.errors import InputError, check_choice, check_number

WINDOW = 4  # pending items read at once: this many batches of the largest size


@dataclass
class BatchOptions:
    items: int | str = 1          # N, or "auto"
    prefill: str = "each"         # each item alone, or one left-padded batch (Runner.generate_items)
    memory_gib: float | None = None
    margin: float = 0.1
    max_items: int = 16

    @property
    def batched(self) -> bool:
        return self.items != 1

    @property
    def largest(self) -> int:
        return self.max_items if self.items == "auto" else int(self.items)


def batch_options(cfg) -> BatchOptions:
    """``cfg.batch``, checked (one line naming the field and what it allows)."""
    node = cfg.get("batch") or {}
    items = node.get("items", 1)
    if isinstance(items, str) and items.strip().isdigit():
        items = int(items)
    if items != "auto" and (isinstance(items, bool) or not isinstance(items, int) or items < 1):
        raise InputError(f"batch.items={items!r} is not allowed; give a positive integer (items in flight) or auto")
    max_items = node.get("max_items", 16)
    if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
        raise InputError(f"batch.max_items={max_items!r} is not allowed; give a positive integer")
    memory = node.get("memory_gib")
    if memory is not None:
        memory = check_number("batch.memory_gib", memory, 0, None, "the memory auto plans a batch for, in GiB")
        if memory <= 0:
            raise InputError(f"batch.memory_gib={memory} must be a number above 0 (GiB), or null")
    margin = check_number("batch.margin", node.get("margin", 0.1), 0, 0.9, "the share of memory left unplanned")
    from .runner import PREFILLS
    prefill = node.get("prefill", "each")
    check_choice("batch.prefill", prefill, PREFILLS)
    return BatchOptions(items, prefill, memory, margin, max_items)


@dataclass
class Entry:
    """A pending item with its prompt, the settings it runs for, and its question part."""
    item: object
    prompt: object
    runs: list
    question: int = 0
    key: tuple = field(init=False)

    def __post_init__(self):
        p = self.prompt
        self.key = (p.max_new_tokens, p.min_new_tokens, tuple(sorted(p.stop_ids)), self.question,
                    tuple(id(run) for run in self.runs))


def cut_batches(entries: list[Entry], size_for) -> list[list[Entry]]:
    """``entries`` as batches: grouped by what they share (``Entry.key``), longest first, each batch as
    many as ``size_for(longest_length, answer_tokens)`` allows."""
    groups: dict = {}
    for entry in entries:
        groups.setdefault(entry.key, []).append(entry)
    batches = []
    for group in groups.values():
        group.sort(key=lambda e: len(e.prompt.ids), reverse=True)
        while group:
            size = max(1, size_for(len(group[0].prompt.ids), group[0].prompt.max_new_tokens))
            batches.append(group[:size])
            group = group[size:]
    return batches


class AutoSize:
    """``batch.items=auto``: the largest batch whose planned peak above the weights fits the budget."""

    def __init__(self, options: BatchOptions, model_cfg, compressors: list, device, together: bool):
        from snapkv.memory import plan_shared

        from .runner import chunking, model_architecture
        self.options, self.compressors, self.together = options, compressors, together
        self.plan_shared = plan_shared
        try:
            self.arch = model_architecture(model_cfg)
            plan_shared(self.arch, 16, compressors)
        except InputError as exc:
            raise InputError(f"batch.items=auto: {exc}; give batch.items=N") from None
        self.kwargs = dict(dtype=str(model_cfg.dtype) if model_cfg.dtype != "auto" else "bfloat16",
                           attn_implementation=model_cfg.get("attn_implementation", "sdpa"),
                           **chunking(model_cfg), device=str(device))
        self.budget = int(self._memory(device) * (1 - options.margin))
        self._cache: dict = {}

    def _memory(self, device) -> int:
        import torch
        if self.options.memory_gib is not None:
            return int(self.options.memory_gib * 2**30)
        if torch.device(device).type == "cuda":
            return torch.cuda.mem_get_info(torch.device(device))[0]
        import psutil
        return psutil.virtual_memory().available

    def peak_above_weights(self, items: int, length: int, answer_tokens: int) -> int:
        """The planned peak of a batch of ``items`` prompts of ``length`` tokens: prefilled one after
        another (the last one's prefill beside every earlier item's kept caches) or as one padded batch,
        then decoded as a batch."""
        plan = self.plan_shared
        kw = dict(decode_tokens=answer_tokens, decode_together=self.together, **self.kwargs)
        batched = plan(self.arch, length, self.compressors, batch=items, padded=self.options.prefill == "padded", **kw)
        if self.options.prefill == "padded":
            return batched["peak_above_weights_bytes"]
        one = plan(self.arch, length, self.compressors, batch=1, **kw)
        prefill = one["prefill_peak_bytes"] + (items - 1) * one["kv_cache_bytes"]
        return max(prefill, batched["decode_peak_bytes"]) - one["weights_bytes"]

    def __call__(self, length: int, answer_tokens: int) -> int:
        key = (length, answer_tokens)
        if key not in self._cache:
            self._cache[key] = next((n for n in range(self.options.max_items, 1, -1)
                                     if self.peak_above_weights(n, length, answer_tokens) <= self.budget), 1)
        return self._cache[key]
