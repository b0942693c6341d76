"""DeepSeek-V3 (HF DeepseekV3ForCausalLM, model_type deepseek_v3: DeepSeek-V3/R1, Moonlight), the family's pure side.

Attention is multi-latent attention (MLA) on every layer: q through a low-rank projection `q_lora_rank` with its
RMSNorm (or directly when it is null: Moonlight), k and v from one compressed latent of `kv_lora_rank` features with
its RMSNorm, plus a RoPE part of `qk_rope_head_dim` features shared by all heads; each head's q/k is
[`qk_nope_head_dim` without RoPE; `qk_rope_head_dim` with], its v `v_head_dim`. RoPE is plain or YaRN (`rope_scaling`
rope_type yarn, with the softmax scale's mscale correction), always on de-interleaved pairs (HF `rope_interleave`).
The KV cache holds the latent and the RoPE key: kv_lora_rank + qk_rope_head_dim features per token and layer.

The MLP of layer i (global, 0-based) is dense (`ffn_hidden_size`, HF `intermediate_size`) for i <
`first_k_dense_replace`, routed experts after it: sigmoid scores; the experts chosen by score + the checkpoint's
score-correction bias (HF `e_score_correction_bias`, which RL does not train) among the best `topk_group` of
`n_group` equal groups (a group scored by the sum of its two best biased scores); the chosen experts weighted by
their unbiased scores, renormalised to sum to 1 and multiplied by `routed_scaling_factor`; `n_shared_experts`
shared experts (one SwiGLU of n_shared_experts * moe_ffn_hidden_size) beside them. What megatron-core cannot compute
the same way is refused, naming the field (`_model_problems`); FP8 checkpoints are refused when their config.json is
read. Multi-token-prediction layers (`num_nextn_predict_layers`, the layers past `num_hidden_layers`, as DeepSeek
releases them) are not trained: where a checkpoint has their weights, conversions carry them through unchanged
(`carried_hf_tensors`). The torch side is `model/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from megatron_scalerl.errors import UserError
from megatron_scalerl.families.spec import FamilySpec, LayerPlan
from megatron_scalerl.section import NonNeg, Pos, PosFloat, Section

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig

# the config.json values of the routing we compute (released DeepSeek-V3/R1 and Moonlight files carry them; vLLM
# reads them to choose its router)
_TOPK_METHOD = "noaux_tc"
_SCORING = "sigmoid"
_GROUP_SCORE_TOP = 2  # HF scores an expert group by the sum of its top-2 biased scores
# multi-latent attention's sizes: model-section fields named as their HF keys (q_lora_rank may be null)
_LATENT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_REQUIRED = ("intermediate_size", *_LATENT[1:])
# transformers' DeepseekV3Config defaults, for the routing keys a config.json leaves out
_HF_DEFAULTS = dict(n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, norm_topk_prob=True,
                    n_group=8, topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=3)



class DeepseekV3Fields(Section):
    """The model-section fields only DeepSeek-V3 reads, named after their HF keys: multi-latent attention and grouped
    routing (and, with Qwen3-MoE, norm_topk_prob); another family's model refuses them away from these defaults."""

    norm_topk_prob: bool = Field(
        True, description="softmax routing (Qwen3-MoE): the top-k weights renormalised to sum to 1 (HF's key)")
    q_lora_rank: Pos | None = Field(
        None, description="DeepSeek-V3: rank of the query's low-rank projection (features); null: q projected directly")
    kv_lora_rank: Pos | None = Field(
        None, description="DeepSeek-V3: rank of the compressed key/value latent, what the KV cache holds (features)")
    qk_nope_head_dim: Pos | None = Field(
        None, description="DeepSeek-V3: features of each q/k head without RoPE (features)")
    qk_rope_head_dim: Pos | None = Field(
        None, description="DeepSeek-V3: features of each q/k head with RoPE, one k part shared by all heads (features)")
    v_head_dim: Pos | None = Field(None, description="DeepSeek-V3: features of each value head (features)")
    n_group: Pos = Field(1, description="DeepSeek-V3 routing: the experts form this many equal groups (count)")
    topk_group: Pos = Field(
        1, description="DeepSeek-V3 routing: each token picks its experts from its best this-many groups (count)")
    routed_scaling_factor: PosFloat = Field(
        1.0, description="DeepSeek-V3 routing: the routed experts' weights are multiplied by this (ratio)")
    n_shared_experts: NonNeg = Field(
        0, description="DeepSeek-V3: shared experts beside the routed ones, moe_ffn_hidden_size each (count)")
    first_k_dense_replace: NonNeg = Field(
        0, description="DeepSeek-V3: the first this-many layers have the dense MLP, the rest routed experts (layers)")
    num_nextn_predict_layers: NonNeg = Field(
        0, description="DeepSeek-V3: multi-token-prediction layers the checkpoint declares after its last decoder "
                       "layer (layers); not trained: their weights, where the checkpoint has them, are carried "
                       "through conversions unchanged")


def _layer(model_cfg: ModelConfig, layer: int) -> LayerPlan:
    moe = model_cfg.is_moe and layer >= model_cfg.first_k_dense_replace
    return LayerPlan(moe=moe, rope=True, qk_norm=None, attention_chunk=None,
                     shared_experts=model_cfg.n_shared_experts if moe else 0, router_expert_bias=moe,
                     latent_attention=True)


def _hf_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    dense_layers = model_cfg.first_k_dense_replace if model_cfg.is_moe else model_cfg.num_layers
    return dict(
        intermediate_size=model_cfg.ffn_hidden_size,
        moe_intermediate_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
        n_routed_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.moe_router_topk,
        n_shared_experts=model_cfg.n_shared_experts,
        n_group=model_cfg.n_group,
        topk_group=model_cfg.topk_group,
        routed_scaling_factor=model_cfg.routed_scaling_factor,
        norm_topk_prob=model_cfg.norm_topk_prob,
        first_k_dense_replace=dense_layers,
        moe_layer_freq=1,
        topk_method=_TOPK_METHOD,
        scoring_func=_SCORING,
        **{field: getattr(model_cfg, field) for field in _LATENT},
        rope_interleave=True,
        num_nextn_predict_layers=model_cfg.num_nextn_predict_layers,
    )


def _refuse(source: str, field: str, value: Any, why: str) -> None:
    raise UserError(f"{source}: {field}={value!r}: {why}")


def _model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        _refuse(source, "quantization_config", method, "an FP8 (quantized) checkpoint is not trained here: convert it "
                "to bf16 first (DeepSeek's inference/fp8_cast_bf16.py) and drop quantization_config from config.json")
    for field, ours in (("topk_method", _TOPK_METHOD), ("scoring_func", _SCORING), ("rope_interleave", True),
                        ("moe_layer_freq", 1)):
        if config.get(field, ours) != ours:
            _refuse(source, field, config[field], f"only {ours!r} is computed (DeepSeek-V3's)")
    missing = [key for key in _REQUIRED if config.get(key) is None]
    if missing:
        raise UserError(f"{source}: {', '.join(missing)} missing (a DeepSeek-V3 config.json states them)")
    config = {**_HF_DEFAULTS, **{key: value for key, value in config.items() if value is not None}}
    # routed experts on the layers from first_k_dense_replace on (none when it is past the last); without any, the
    # routing fields keep the model section's defaults
    routing = dict(
        num_experts=config["n_routed_experts"],
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_router_topk=config["num_experts_per_tok"],
        norm_topk_prob=bool(config["norm_topk_prob"]),
        n_group=config["n_group"],
        topk_group=config["topk_group"],
        routed_scaling_factor=float(config["routed_scaling_factor"]),
        n_shared_experts=config["n_shared_experts"],
        first_k_dense_replace=config["first_k_dense_replace"],
    ) if config["n_routed_experts"] else {}
    return dict(
        num_nextn_predict_layers=config.get("num_nextn_predict_layers") or 0,
        head_dim=config["qk_rope_head_dim"],  # as transformers' DeepseekV3Config sets it
        ffn_hidden_size=config["intermediate_size"],
        **routing,
        **{field: config.get(field) for field in _LATENT},  # q_lora_rank null: q projected directly (Moonlight)
    )


def _model_problems(model_cfg: ModelConfig) -> list[tuple[str, str]]:
    """What megatron-core's MLA and router cannot compute as DeepSeek-V3 does."""
    problems = [(field, "multi-latent attention needs it") for field in _LATENT[1:] if getattr(model_cfg, field) is None]
    if model_cfg.num_query_groups != model_cfg.num_attention_heads:
        problems.append(("num_query_groups", "multi-latent attention gives every head its own k and v: "
                                             "num_attention_heads (HF num_key_value_heads)"))
    if model_cfg.qk_rope_head_dim is not None and model_cfg.head_dim != model_cfg.qk_rope_head_dim:
        problems.append(("head_dim", "qk_rope_head_dim, as HF's DeepseekV3Config sets it"))
    if model_cfg.moe_layer_interval != 1:
        problems.append(("moe_layer_interval", "1: the dense layers are the first first_k_dense_replace"))
    if not model_cfg.is_moe:
        return problems
    groups, chosen, topk = model_cfg.n_group, model_cfg.topk_group, model_cfg.moe_router_topk
    if model_cfg.num_experts % groups:
        problems.append(("n_group", f"must divide num_experts ({model_cfg.num_experts})"))
    if chosen > groups:
        problems.append(("topk_group", f"at most n_group ({groups})"))
    elif groups > 1 and topk != _GROUP_SCORE_TOP * chosen:
        problems.append(("topk_group", f"megatron scores a group by its top moe_router_topk / topk_group = "
                                       f"{topk / chosen:g} experts, HF by its top {_GROUP_SCORE_TOP}: only "
                                       f"moe_router_topk = {_GROUP_SCORE_TOP} x topk_group is computed as HF does"))
    if model_cfg.norm_topk_prob != (topk > 1):
        problems.append(("norm_topk_prob", f"{str(model_cfg.norm_topk_prob).lower()} is not computed at "
                                           f"moe_router_topk={topk}: megatron renormalises the chosen experts' sigmoid "
                                           "weights to sum to 1 when, and only when, moe_router_topk > 1"))
    if model_cfg.n_shared_experts == 0:
        problems.append(("n_shared_experts", "at least 1 (the released models' 1 or 2; none is not mapped)"))
    return problems


FAMILY = FamilySpec(
    name="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    hf_model_type="deepseek_v3",
    moe=True,
    layer=_layer,
    hf_fields=_hf_fields,
    model_fields=_model_fields,
    model_problems=_model_problems,
    fields=DeepseekV3Fields,
    rope_types=("default", "yarn"),
)
