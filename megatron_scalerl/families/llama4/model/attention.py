"""Llama-4 core attention: chunked local attention on RoPE layers, attention temperature tuning on NoPE layers.

megatron-core 0.16.1 has neither. Hugging Face `Llama4TextAttention` (the oracle) does, per layer:
  - RoPE layers (`config.no_rope_freq[layer] == 0`): token i attends to token j only if j <= i and both lie in the
    same chunk of `attention_chunk_size` tokens (`create_chunked_causal_mask`);
  - NoPE layers: ordinary causal attention over the whole sequence, with queries scaled by
    `log1p(floor((position + 1) / floor_scale)) * attn_scale + 1` when temperature tuning is on.

Chunked attention is computed exactly by folding the chunks into the batch dimension and running the backend's
own causal attention (local `DotProductAttention` on CPU, `TEDotProductAttention` on GPU) on chunk-long sequences:
    [s, b, heads, d] -> pad s to n*chunk -> [chunk, n*b, heads, d] -> causal attention -> unfold -> [s, b, heads*d]
Padding sits at the end of the last chunk, so causality keeps real queries from seeing it; padded rows are dropped.
Memory and compute are O(s * chunk) instead of O(s^2).

Positions are sequence indices 0..s-1 (no packing, no KV-cache offsets): the trainer runs whole sequences, causal.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def fold_chunks(x: Tensor, chunk: int) -> Tensor:
    """[s, b, ...] -> [chunk, ceil(s/chunk) * b, ...], zero-padding the sequence at the end."""
    s, b = x.shape[:2]
    n = math.ceil(s / chunk)
    if n * chunk != s:
        x = torch.cat([x, x.new_zeros((n * chunk - s, *x.shape[1:]))], dim=0)
    return x.reshape(n, chunk, b, *x.shape[2:]).transpose(0, 1).reshape(chunk, n * b, *x.shape[2:])


def unfold_chunks(y: Tensor, seq_len: int, batch: int) -> Tensor:
    """Inverse of `fold_chunks` for attention output [chunk, n * b, h] -> [seq_len, b, h]."""
    chunk, nb = y.shape[:2]
    n = nb // batch
    return y.reshape(chunk, n, batch, *y.shape[2:]).transpose(0, 1).reshape(n * chunk, batch, *y.shape[2:])[:seq_len]


def temperature_scales(seq_len: int, floor_scale: float, attn_scale: float, device: torch.device) -> Tensor:
    """Per-position query scales [seq_len] (fp32): log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    return torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4AttentionMixin:
    """Put before a megatron core-attention class (see `llama4_core_attention`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        layer_index = kwargs["layer_number"] - 1  # megatron layer numbers are global and 1-based
        self.uses_rope = not (config.no_rope_freq and config.no_rope_freq[layer_index])
        self.chunk_size = config.attention_chunk_size if self.uses_rope else None
        self.temperature_tuning = config.attn_temperature_tuning and not self.uses_rope
        self.floor_scale = config.attn_floor_scale
        self.temperature_scale = config.attn_temperature_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,  # noqa: ANN001
        attention_bias: Tensor | None = None,
        packed_seq_params=None,  # noqa: ANN001
    ) -> Tensor:
        """query [s, b, heads, d]; key, value [s, b, groups, d] -> [s, b, heads * d]."""
        if attention_mask is not None or packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "Llama-4 attention runs causal on whole sequences: pass attention_mask=None, no packed sequences"
            )
        seq_len, batch = query.shape[:2]
        if self.temperature_tuning:
            scales = temperature_scales(seq_len, self.floor_scale, self.temperature_scale, query.device)
            query = (query * scales.view(seq_len, 1, 1, 1)).to(query.dtype)
        if self.chunk_size is None or seq_len <= self.chunk_size:
            return super().forward(query, key, value, None, attn_mask_type=attn_mask_type)
        folded = super().forward(
            fold_chunks(query, self.chunk_size),
            fold_chunks(key, self.chunk_size),
            fold_chunks(value, self.chunk_size),
            None,
            attn_mask_type=attn_mask_type,
        )
        return unfold_chunks(folded, seq_len, batch)


def llama4_core_attention(base: type) -> type:
    """The backend's core-attention class with Llama-4's chunking and temperature tuning in front of it."""
    return type(f"Llama4{base.__name__}", (Llama4AttentionMixin, base), {})
