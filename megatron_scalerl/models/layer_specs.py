"""Per-layer megatron-core specs for both families, built on the backend's base spec (TE or local, see
`platform.layer_backend`).

Dense Llama-3: every layer is the base spec. Llama-4: each layer gets a MoE or dense MLP (`moe_layer_interval`),
L2 QK norm only on RoPE layers (HF `use_qk_norm and use_rope`), and `llama4_core_attention` (chunked attention on
RoPE layers, temperature tuning on NoPE layers). Only the layers of this pipeline stage are built.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_scalerl.models.arch import is_moe_layer, is_rope_layer
from megatron_scalerl.models.config import ScaleRLTransformerConfig
from megatron_scalerl.models.llama4_attention import llama4_core_attention
from megatron_scalerl.platform.layer_backend import base_layer_spec, final_norm_spec
from megatron_scalerl.recipe import ModelConfig


def layer_spec(model_cfg: ModelConfig, layer: int) -> ModuleSpec:
    """The spec of global 0-based `layer`."""
    if model_cfg.arch == "llama3":
        return base_layer_spec(num_experts=None, qk_l2_norm=False)
    rope = is_rope_layer(model_cfg, layer)
    spec = copy.deepcopy(
        base_layer_spec(
            num_experts=model_cfg.num_experts if is_moe_layer(model_cfg, layer) else None,
            qk_l2_norm=model_cfg.use_qk_norm and rope,
        )
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = llama4_core_attention(attention.core_attention)
    if not (model_cfg.use_qk_norm and rope):
        attention.q_layernorm = IdentityOp
        attention.k_layernorm = IdentityOp
    return spec


def decoder_block_spec(
    model_cfg: ModelConfig, config: ScaleRLTransformerConfig, *, pp_rank: int, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """Specs of the layers that pipeline stage `pp_rank` builds, plus the final norm."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    specs = [layer_spec(model_cfg, layer) for layer in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm_spec())


def stage_layers(config: ScaleRLTransformerConfig, *, pp_rank: int, vp_stage: int | None = None) -> range:
    """Global 0-based indices of the layers pipeline stage `pp_rank` holds."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
