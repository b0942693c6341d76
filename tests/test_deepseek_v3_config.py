"""What a DeepSeek-V3 config.json or recipe model section may say that our models do not compute is refused, naming
the file or the field and what to do; YaRN RoPE belongs to the families that compute it."""

from __future__ import annotations

import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.families import hf_config_dict
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, load_recipe, model_config_from_hf
from megatron_scalerl.recipe.rules import layout_problems


def _tiny() -> ModelConfig:
    return load_recipe("scalerl", model_preset="tiny_deepseek_v3").model


def test_config_json_goes_both_ways_with_what_vllm_reads():
    config = hf_config_dict(_tiny())
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"  # vLLM's router choice
    assert config["num_nextn_predict_layers"] == 0 and config["rope_parameters"]["rope_type"] == "yarn"
    assert model_config_from_hf(config) == _tiny()


@pytest.mark.parametrize("declared", [1, 2, None])
def test_a_declared_multi_token_prediction_layer_is_read_and_written_back(declared):
    """As released (1) and as transformers' DeepseekV3Config writes it by default (1, with no MTP weights): read, not
    refused, and written back; a config without the key (None) has none."""
    config = {**hf_config_dict(_tiny()), "num_nextn_predict_layers": declared}
    model = model_config_from_hf(config, "x/config.json")
    assert model.num_nextn_predict_layers == (declared or 0)
    assert hf_config_dict(model)["num_nextn_predict_layers"] == (declared or 0)


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config='fp8': an FP8 (quantized) checkpoint"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy': only 'noaux_tc'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax': only 'sigmoid'"),
    ({"rope_interleave": False}, "rope_interleave=False: only True"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2: only 1"),
])
def test_config_json_refusals(change, message):
    with pytest.raises(UserError) as refused:
        model_config_from_hf({**hf_config_dict(_tiny()), **change}, "x/config.json")
    assert str(refused.value).startswith(f"x/config.json: {message}")


@pytest.mark.parametrize("change, message", [
    ({"moe_router_topk": 4}, "topk_group: megatron scores a group by its top moe_router_topk / topk_group = 4"),
    ({"norm_topk_prob": False}, "norm_topk_prob: false is not computed"),
    ({"moe_router_topk": 1, "topk_group": 1, "n_group": 1}, "norm_topk_prob: true is not computed at moe_router_topk=1"),
    ({"n_shared_experts": 0}, "n_shared_experts: at least 1"),
    ({"n_group": 3}, "n_group: must divide num_experts (8)"),
    ({"num_query_groups": 2}, "num_query_groups: multi-latent attention gives every head its own k and v"),
    ({"kv_lora_rank": None}, "kv_lora_rank: multi-latent attention needs it"),
    ({"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 512}}, "rope_scaling: rope_type llama3 is not computed"),
])
def test_model_section_refusals(change, message):
    with pytest.raises(ValueError, match="arch deepseek_v3") as refused:
        ModelConfig.model_validate({**_tiny().model_dump(), **change})
    assert message in str(refused.value)


def test_missing_keys_take_transformers_defaults_or_are_named():
    config = {k: v for k, v in hf_config_dict(_tiny()).items() if k not in ("norm_topk_prob", "first_k_dense_replace")}
    read = model_config_from_hf(config)
    assert (read.norm_topk_prob, read.first_k_dense_replace) == (True, 3)  # transformers' DeepseekV3Config's
    with pytest.raises(UserError, match="x/config.json: kv_lora_rank missing"):
        model_config_from_hf({k: v for k, v in config.items() if k != "kv_lora_rank"}, "x/config.json")


def test_the_routing_bias_travels_and_converts_in_fp32():
    import torch

    from megatron_scalerl.models.mapping import kept_fp32
    from megatron_scalerl.weight_sync.sender import wire_dtype

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert kept_fp32(bias) and not kept_fp32("model.layers.1.mlp.gate.weight")
    assert wire_dtype(bias, torch.bfloat16, False, tied=False) == torch.float32
    assert wire_dtype("model.layers.1.mlp.gate.weight", torch.bfloat16, True, tied=False) == torch.bfloat16


@pytest.mark.parametrize("rope, message", [
    ({"mscale": 2.0, "mscale_all_dim": 0.0}, "mscale=2.0 with mscale_all_dim=0.0: transformers and megatron"),
    ({"attention_factor": 1.3}, "attention_factor=1.3 is not supported"),
    ({"truncate": False}, "truncate=False is not supported"),
])
def test_yarn_settings_megatron_computes_otherwise_are_refused(rope, message):
    config = hf_config_dict(_tiny())
    config["rope_parameters"] = {**config["rope_parameters"], **rope}
    with pytest.raises(UserError, match=f"x/config.json: rope_parameters {message}"):
        model_config_from_hf(config, "x/config.json")


def test_yarn_is_refused_for_a_family_that_does_not_compute_it():
    qwen3 = load_recipe("scalerl", model_preset="tiny_qwen3").model.model_dump()
    yarn = _tiny().rope_scaling.model_dump()
    with pytest.raises(ValueError, match="rope_scaling: rope_type yarn is not computed by arch qwen3"):
        ModelConfig.model_validate({**qwen3, "rope_scaling": yarn})


def test_dense_latent_attention_at_tp2_needs_sequence_parallelism():
    dense = ModelConfig.model_validate({**_tiny().model_dump(), "num_experts": 0, "moe_ffn_hidden_size": None,
                                        "n_group": 1, "topk_group": 1, "n_shared_experts": 0,
                                        "first_k_dense_replace": 0, "moe_router_topk": 1})
    assert layout_problems(dense, ParallelismConfig(tp=2)) == [
        ("parallelism.sequence_parallel", "multi-latent attention with tp=2 > 1 needs sequence_parallel: true")]
    assert layout_problems(dense, ParallelismConfig(tp=2, sequence_parallel=True)) == []
