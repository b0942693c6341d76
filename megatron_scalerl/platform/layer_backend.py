"""Transformer Engine vs megatron-core's local modules: the one place that chooses.

GPU processes with Transformer Engine importable use TE layer specs (fused kernels, TE attention); CPU processes
(and GPU processes without TE) use the local spec, whose norms we replace with `TorchNorm` so that sequence
parallelism works (megatron's `WrappedTorchNorm` refuses it). Model code asks for `base_layer_spec(...)` and never
imports TE itself.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from megatron.core.transformer.spec_utils import ModuleSpec


@functools.cache
def use_transformer_engine() -> bool:
    """True on a CUDA machine where Transformer Engine imports; False on CPU (TE cannot be installed there)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


class TorchNorm:
    """RMSNorm/LayerNorm from torch, built like megatron's norms (`config`, `hidden_size`, `eps`).

    Unlike megatron's `WrappedTorchNorm` it accepts sequence parallelism: its parameters are tagged
    `sequence_parallel`, so megatron all-reduces their gradients across the tensor-parallel group (each TP rank
    normalises a different slice of the sequence).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:  # noqa: ANN001
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"TorchNorm: unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def base_layer_spec(*, num_experts: int | None, qk_norm: str | None, latent_attention: bool = False) -> ModuleSpec:
    """megatron-core's GPT layer spec for the chosen backend (RMSNorm, sequential experts when MoE), with q/k norms
    as `qk_norm` says (`families.spec.LayerPlan`): "l2" (parameter-free), "rms" (RMSNorm over each head's
    head_dim, a weight of its own; the TransformerConfig must say `qk_layernorm=True` too, so that megatron
    all-reduces those weights' gradients over TP) or None.

    `latent_attention`: megatron-core's multi-latent attention (`MLASelfAttention`) with the RMSNorms of its q and
    kv latents. The down-projections are whole on every TP rank on both backends, as Transformer Engine's spec has
    them: megatron's local spec makes them column-parallel and gathers their outputs, and that gather's backward
    keeps only this rank's heads' share of the shared RoPE key's gradient (wrong gradients at TP > 1); whole, with
    sequence parallelism (which the recipe rules require for it at TP > 1), the key's sequence gather sums that
    gradient over TP. The local spec keeps the latents' norms as modules of their own (`q_layernorm`,
    `kv_layernorm`), TE's fuses them into the up-projections (`linear_q_up_proj.layer_norm_weight`). The local core
    attention takes one head size only: the family replaces it (`families/deepseek_v3/model/attention.py`).

    Experts are `SequentialMLP` on both backends (grouped GEMM is unavailable on CPU and would change the expert
    parameter names that the HF mapping relies on).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    norms = dict(qk_l2_norm=qk_norm == "l2", qk_layernorm=qk_norm == "rms" or latent_attention)
    if use_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, multi_latent_attention=latent_attention, **norms
        )
    if latent_attention and torch.cuda.is_available():
        raise RuntimeError("multi-latent attention on a GPU needs Transformer Engine (megatron's local MLA layers "
                           "run here on CPUs only): install it (pip install -e '.[gpu]')")
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
        multi_latent_attention=latent_attention, **norms
    )
    spec.submodules.input_layernorm = TorchNorm
    spec.submodules.pre_mlp_layernorm = TorchNorm
    # megatron's WrappedTorchNorm refuses sequence parallelism, which MoE at TP > 1 needs
    attention = spec.submodules.self_attention.submodules
    if latent_attention:
        from megatron.core.post_training.modelopt.layers import Linear  # megatron's whole-on-every-rank linear

        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
        attention.q_layernorm = attention.kv_layernorm = TorchNorm
    elif qk_norm == "rms":
        attention.q_layernorm = attention.k_layernorm = TorchNorm
    return spec


def final_norm_spec() -> type:
    """The norm after the last transformer layer."""
    if use_transformer_engine():
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return TorchNorm
