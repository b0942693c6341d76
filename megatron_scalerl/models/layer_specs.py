"""The megatron-core specs of a pipeline stage's decoder layers: each from its model family's `layer_spec`
(`models.family`, on the backend's base spec: `platform.layer_backend`). Only the layers of this stage are built.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_scalerl.models.config import ScaleRLTransformerConfig
from megatron_scalerl.models.family import model_parts
from megatron_scalerl.platform.layer_backend import final_norm_spec
from megatron_scalerl.recipe import ModelConfig


def decoder_block_spec(
    model_cfg: ModelConfig, config: ScaleRLTransformerConfig, *, pp_rank: int, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """Specs of the layers that pipeline stage `pp_rank` builds, plus the final norm."""
    layer_spec = model_parts(model_cfg).layer_spec
    specs = [layer_spec(model_cfg, layer) for layer in stage_layers(config, pp_rank=pp_rank, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm_spec())


def stage_layers(config: ScaleRLTransformerConfig, *, pp_rank: int, vp_stage: int | None = None) -> range:
    """Global 0-based indices of the layers pipeline stage `pp_rank` holds."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
