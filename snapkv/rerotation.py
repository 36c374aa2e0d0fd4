"""Re-rotated keys (``Method.rerotates_keys``): kept keys moved from their prompt positions to ``0..n-1``.

A RoPE key at position ``p`` is ``R(p) k``; rotating it by ``R(j - p)`` gives ``R(j) k``, the key it would be at
position ``j``. After a cut that keeps positions ``p_0 < ... < p_{n-1}`` each kept key ``i`` is rotated to position
``i``, so the layer holds the keys of a contiguous prompt of ``n`` tokens and decoding continues at position ``n``.
The arithmetic is kvpress 0.5.5's ``KeyRerotationPress.rerotate_keys``: the angle ``(j - p) * inv_freq`` in
float32 (with autocast off), its cosine and sine cast to the keys' dtype, then ``k cos + rotate_half(k) sin``.
"""
from __future__ import annotations

import torch

from .errors import InputError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The Llama family's ``rotate_half``: ``[-x2, x1]`` of the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotated_keys(keys: torch.Tensor, kept: torch.Tensor, rotary) -> torch.Tensor:
    """``keys`` ``[b, heads, n, d]`` (the kept keys, gathered), held at the prompt positions ``kept``
    ``[b, heads, n]`` (ascending), rotated to positions ``0..n-1`` with the model's rotary embedding ``rotary``
    (its ``inv_freq``)."""
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        raise InputError("rerotated keys need the model's rotary embedding (model.model.rotary_emb.inv_freq); "
                         "this model has none")
    n = kept.shape[-1]
    device_type = keys.device.type if keys.device.type != "mps" else "cpu"
    with torch.autocast(device_type=device_type, enabled=False):
        delta = torch.arange(n, device=keys.device, dtype=torch.float32) - kept.to(keys.device)
        angles = delta.float()[..., None] * inv_freq.to(keys.device).float()  # [b, heads, n, d/2]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin
