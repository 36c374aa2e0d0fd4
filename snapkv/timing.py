"""Timing the compression inside a prefill without stalling the device.

A span is read only after the device has finished its work: on CUDA a pair of events recorded on the
stream (no synchronisation inside the hooks), elsewhere ``time.perf_counter`` at once. A ``Ledger``
adds and subtracts spans, so a setting's compression time can be what its solo run would pay even when
a shared prefill computed part of it for another setting (``snapkv.hooks``: a score several settings
share is added to each that reads it, and taken out of the setting that happened to compute it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Clock:
    """Starts and stops spans of work on one device."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def stop(self, started):
        """The span from ``started`` to now (read it with ``seconds`` once the device is idle)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return started, event
        return time.perf_counter() - started


def seconds(span) -> float:
    if isinstance(span, tuple):
        start, end = span
        return start.elapsed_time(end) / 1000.0
    return float(span)


@dataclass
class Ledger:
    """Signed spans: ``total()`` is their sum in seconds (read after the device is synchronised)."""

    terms: list = field(default_factory=list)

    def add(self, span, sign: int = 1) -> None:
        self.terms.append((sign, span))

    def total(self) -> float:
        return max(0.0, sum(sign * seconds(span) for sign, span in self.terms))
