"""Core attention for multi-latent attention on megatron-core's local (non-Transformer-Engine) layers.

megatron-core 0.16.1's `MLASelfAttention` gives its core attention queries and keys of qk_nope_head_dim +
qk_rope_head_dim features and values of v_head_dim (`k_channels`, `v_channels`, and the YaRN-corrected
`softmax_scale`); the local `DotProductAttention` assumes one head size and takes none of them. This one computes
causal softmax attention on whole sequences with those sizes (Transformer Engine's attention takes them itself, so
GPU layers keep it):
    query, key [s, b, heads, dk]; value [s, b, heads, dv] -> [s, b, heads * dv]
The softmax runs in FP32 whatever the body dtype, as the local attention's does (`attention_softmax_in_fp32`).
"""

from __future__ import annotations

import torch
from torch import Tensor


class LatentCoreAttention(torch.nn.Module):
    """Causal attention with separate q/k and v head sizes (built by megatron's `build_module`)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,  # noqa: ANN001
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 **_unused) -> None:
        """megatron's `Attention` builds one without the sizes, which `MLASelfAttention` then replaces."""
        super().__init__()
        if config.attention_dropout:
            raise ValueError("multi-latent core attention: attention_dropout must be 0 (RL trains without it)")
        self.softmax_scale = softmax_scale
        self.k_channels, self.v_channels = k_channels, v_channels

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, packed_seq_params=None, **_unused) -> Tensor:  # noqa: ANN001
        if attention_mask is not None or packed_seq_params is not None:
            raise NotImplementedError("multi-latent attention runs causal on whole sequences: pass attention_mask="
                                      "None, no packed sequences")
        seq, batch, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, heads, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(seq, batch, heads * self.v_channels)
