"""Recipe `ModelConfig` + `ParallelismConfig` -> megatron-core `TransformerConfig`.

The architecture facts every family shares with Hugging Face (RMSNorm, SwiGLU, no biases, untied or tied
embeddings, GQA) and the MoE machinery every MoE family uses (routed experts, alltoall dispatch, routing replay, the
optional auxiliary loss) are set here; which layers are MoE or NoPE comes from the family's `LayerPlan`s
(`families`), and what only a family computes (its q/k norm, its router's score function and where the score is
applied, a shared expert, Llama-4's chunked attention) from its `ModelParts.config_fields`. Fields that megatron-core
0.16.1 does not have live in `ScaleRLTransformerConfig` and are read by Llama-4's attention module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_scalerl.families import layer_plan
from megatron_scalerl.models.arch import check_model_layout
from megatron_scalerl.models.family import model_parts
from megatron_scalerl.platform.layer_backend import use_transformer_engine
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig


@dataclass
class ScaleRLTransformerConfig(MLATransformerConfig):
    """megatron-core's TransformerConfig with its multi-latent-attention fields (`MLATransformerConfig`, off unless
    a family's `config_fields` turns `multi_latent_attention` on: DeepSeek-V3) plus the Llama-4 attention settings
    megatron-core 0.16.1 lacks (read by `families/llama4/model/attention.py`)."""

    multi_latent_attention: bool = False  # MLATransformerConfig's default is on
    attention_chunk_size: int | None = None  # tokens; RoPE layers attend only within their chunk
    attn_temperature_tuning: bool = False  # NoPE layers scale queries by log1p(floor((pos+1)/floor_scale))*s+1
    attn_floor_scale: float = 8192.0  # tokens
    attn_temperature_scale: float = 0.1


def transformer_config(
    model_cfg: ModelConfig, parallel_cfg: ParallelismConfig, *, params_dtype: torch.dtype = torch.float32
) -> ScaleRLTransformerConfig:
    """The megatron-core config for `model_cfg` split as `parallel_cfg`, weights in `params_dtype`."""
    check_model_layout(model_cfg, parallel_cfg)
    on_gpu = use_transformer_engine()
    n = model_cfg.num_layers
    layers = [layer_plan(model_cfg, i) for i in range(n)]
    parts = model_parts(model_cfg)
    moe: dict = {}
    if model_cfg.is_moe:
        aux = model_cfg.moe_aux_loss_coeff
        moe_layers = [plan for plan in layers if plan.moe]
        shared = max((plan.shared_experts for plan in moe_layers), default=0)
        moe = dict(
            num_moe_experts=model_cfg.num_experts,
            moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size,
            moe_router_topk=model_cfg.moe_router_topk,
            # the load-balancing loss (off by default in RL: model.moe_aux_loss_coeff; docs/model_families.md)
            moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
            moe_aux_loss_coeff=aux,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_layer_freq=[int(plan.moe) for plan in layers],
            moe_apply_probs_on_input=any(plan.expert_input_weighted for plan in moe_layers),
            # shared experts: one SwiGLU of their count times the routed size (LayerPlan.shared_experts)
            moe_shared_expert_intermediate_size=shared * model_cfg.moe_ffn_hidden_size if shared else None,
            # a checkpoint's score-correction bias (LayerPlan.router_expert_bias): an FP32 buffer, never moved by
            # training (megatron's update runs at rate 0)
            moe_router_enable_expert_bias=any(plan.router_expert_bias for plan in moe_layers),
            moe_router_bias_update_rate=0.0,
            # each router asks its RouterReplay for its top-k; with no replay action set (the default) it computes
            # its own, unchanged. The trainer sets the actions (trainer/routing_replay.py).
            moe_enable_routing_replay=True,
        )
    no_rope = [int(not plan.rope) for plan in layers]
    return ScaleRLTransformerConfig(
        num_layers=n,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_interleaved=parts.rotary_interleaved,
        rotary_base=model_cfg.rope_theta,  # MLATransformerConfig's field: MLA's own RoPE, GPTModel's attribute
        no_rope_freq=no_rope if any(no_rope) else None,
        tensor_model_parallel_size=parallel_cfg.tp,
        pipeline_model_parallel_size=parallel_cfg.pp,
        expert_model_parallel_size=parallel_cfg.ep,
        expert_tensor_parallel_size=parallel_cfg.expert_tp_size,
        sequence_parallel=parallel_cfg.sequence_parallel and parallel_cfg.tp > 1,
        pipeline_dtype=params_dtype if parallel_cfg.pp > 1 else None,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
           if parallel_cfg.recompute == "full" else {}),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=on_gpu,  # torch.compile'd SwiGLU / bias-dropout-add: GPU only (see cpu_compat)
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,  # a kernel of the local attention; TE attention has its own
        apply_rope_fusion=False,  # the unfused RoPE is the path the HF parity tests check
        persist_layer_norm=False,  # an Apex option
        **moe,
        **parts.config_fields(model_cfg),
    )
