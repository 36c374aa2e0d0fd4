"""Run each decoder layer's MLP over the sequence in chunks during long prefills.

The MLP is position-wise, so chunking changes no result; it bounds the intermediate activations
(``L x intermediate_size``) that otherwise dominate memory at hundreds of thousands of tokens.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .architectures import decoder_layers, replaced_forwards
from .errors import InputError


def _chunked(forward, chunk: int):
    def run(hidden_states, *args, **kwargs):
        if hidden_states.dim() != 3 or hidden_states.shape[1] <= chunk:
            return forward(hidden_states, *args, **kwargs)
        batch = hidden_states.shape[0]
        # MoE blocks flatten their input with .view(), which a slice along the sequence of a batch
        # of several rows does not allow: each chunk is made contiguous
        parts = [forward(part.contiguous(), *args, **kwargs) for part in hidden_states.split(chunk, dim=1)]
        if not isinstance(parts[0], tuple):
            return torch.cat(parts, dim=1)
        # (hidden, router_logits): the logits are [batch * chunk, experts] rows, batch-major
        hidden = torch.cat([p[0] for p in parts], dim=1)
        rest = [torch.cat([p[i].reshape(batch, -1, *p[i].shape[1:]) for p in parts], dim=1).flatten(0, 1)
                for i in range(1, len(parts[0]))]
        return (hidden, *rest)
    return run


@contextmanager
def chunked_mlp(model, chunk: int):
    if chunk < 1:
        raise InputError(f"mlp_chunk={chunk} must be a positive number of tokens")
    mlps = [getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None) for layer in decoder_layers(model)]
    with replaced_forwards([mlp for mlp in mlps if mlp is not None], lambda mlp, forward: _chunked(forward, chunk)):
        yield
