"""Megatron-core models of every model family (`families/`: Llama-3, Llama-4 MoE text, Qwen3, Qwen3-MoE), their
FP32 output layer, and the HF mapping. Each family's torch side (`families/<name>/model`) is part of this layer:
`models.family`.

Stable API (imported lazily, so `import megatron_scalerl.models` does not load megatron-core):
    build_model(model_cfg, parallel_cfg, *, fp32_lm_head, params_dtype, pre_process, post_process) -> GPTModel
        forward(input_ids [b, s], position_ids [b, s], attention_mask=None) -> logits [b, s, padded_vocab / tp] on the
        last pipeline stage (vocab-parallel, not gathered); hidden states [s, b, h] on earlier stages.
        FP32 head on: FP32 weights and logits (a tied embedding FP32 too); off: logits in `params_dtype`.
    transformer_config(model_cfg, parallel_cfg, *, params_dtype) -> ScaleRLTransformerConfig
    load_hf_state(model, hf_state, model_cfg)            HF-named tensors -> this rank's shard
    hf_to_megatron_state(hf_state, model_cfg, ranks)     the same, as a dict (no model needed)
    export_hf_state(model, model_cfg) -> iter (HF name, full tensor)   collective over TP/EP; per pipeline stage
    read_hf_checkpoint(dir) -> (ModelConfig, lazy HF state)   (config.json <-> ModelConfig: `families`, `recipe`)
    mapping: the weight tables' machinery (TensorRule, ArchitectureMapping, shard/unshard, to_megatron/to_hf); each
        family's table is its `ModelParts.mapping`
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_model": "megatron_scalerl.models.provider",
    "rope_inv_freq": "megatron_scalerl.models.provider",
    "transformer_config": "megatron_scalerl.models.config",
    "ScaleRLTransformerConfig": "megatron_scalerl.models.config",
    "load_hf_state": "megatron_scalerl.models.weights",
    "hf_to_megatron_state": "megatron_scalerl.models.weights",
    "export_hf_state": "megatron_scalerl.models.weights",
    "RankLayout": "megatron_scalerl.models.weights",
    "unwrap_model": "megatron_scalerl.models.weights",
    "read_hf_checkpoint": "megatron_scalerl.models.hf_io",
    "OutputLayer": "megatron_scalerl.models.output_layer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
