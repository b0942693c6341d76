"""HF <-> Megatron mapping tables, HF configs, RoPE frequencies and Llama-4 attention helpers (no process groups).

Oracles: transformers' own models/configs/RoPE code and the checkpoints it writes, the released Llama-3.1-8B /
Llama-4-Scout / Qwen3-0.6B / Qwen3-8B / Qwen3-30B-A3B / Qwen3-235B-A22B / DeepSeek-V3 / Moonlight-16B-A3B configs,
and masked attention written out directly.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megatron_scalerl.errors import UserError
from megatron_scalerl.families import hf_config_dict
from megatron_scalerl.families.llama4.model.attention import fold_chunks, temperature_scales, unfold_chunks
from megatron_scalerl.models import mapping
from megatron_scalerl.models.arch import check_model_layout
from megatron_scalerl.models.provider import rope_inv_freq
from megatron_scalerl.models.weights import RankLayout, hf_to_megatron_state
from megatron_scalerl.recipe import ParallelismConfig, load_recipe, model_config_from_hf

PRESETS = ["tiny_dense", "tiny_moe", "llama3_8b", "llama4_scout_17b_16e"]

# The released config.json of meta-llama/Llama-3.1-8B and the text part of Llama-4-Scout-17B-16E.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA4_SCOUT_TEXT = {
    "attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True,
    "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
    "model_type": "llama4_text", "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "use_qk_norm": True, "vocab_size": 202048, "tie_word_embeddings": False,
}


# The released config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B (transformers-4.51 spelling: rope_theta and
# rope_scaling, num_experts).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
# The released config.json of Qwen/Qwen3-8B and Qwen/Qwen3-235B-A22B (the same spelling).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 94, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 94, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}

# The released config.json of deepseek-ai/DeepSeek-V3 (DeepSeek-R1's is the same), the keys we read or refuse, and of
# moonshotai/Moonlight-16B-A3B(-Instruct).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}
# converted to bf16 (quantization_config dropped), its multi-token-prediction layer declared as released
DEEPSEEK_V3_BF16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
MOONLIGHT_16B_A3B = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 163584,
    "eos_token_id": 163586, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840,
}


def model_cfg(preset: str):
    return load_recipe("scalerl", model_preset=preset).model


def hf_config(cfg):
    d = hf_config_dict(cfg)
    return AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k not in ("model_type", "torch_dtype")})


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_config_round_trip(preset):
    cfg = model_cfg(preset)
    assert model_config_from_hf(hf_config_dict(cfg)) == cfg
    hf = hf_config(cfg)  # transformers accepts it
    assert hf.num_hidden_layers == cfg.num_layers


def test_presets_have_the_released_dimensions():
    assert model_config_from_hf(LLAMA31_8B) == model_cfg("llama3_8b")
    assert model_config_from_hf(LLAMA4_SCOUT_TEXT) == model_cfg("llama4_scout_17b_16e")
    assert model_config_from_hf(QWEN3_8B) == model_cfg("qwen3_8b")
    assert model_config_from_hf(QWEN3_30B_A3B) == model_cfg("qwen3_30b_a3b")
    assert model_config_from_hf(QWEN3_235B_A22B) == model_cfg("qwen3_235b_a22b")
    assert model_config_from_hf(DEEPSEEK_V3_BF16) == model_cfg("deepseek_v3_671b")
    assert model_config_from_hf(MOONLIGHT_16B_A3B) == model_cfg("moonlight_16b_a3b")


def test_released_deepseek_v3_is_refused_until_converted():
    """The released FP8 checkpoint is refused naming quantization_config; converted to bf16 it is read as released,
    its multi-token-prediction layer declared (num_nextn_predict_layers 1, written back as it was)."""
    with pytest.raises(UserError, match=r"^x/config.json: quantization_config='fp8'"):
        model_config_from_hf(DEEPSEEK_V3, "x/config.json")
    bf16 = model_config_from_hf(DEEPSEEK_V3_BF16, "x/config.json")
    assert bf16.num_nextn_predict_layers == 1 and hf_config_dict(bf16)["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn rope scaling lacks original_max_position"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
         "rope_type yarn is not computed by arch llama3"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
    ],
)
def test_hf_config_refusals(change, message):
    with pytest.raises(UserError, match=message):
        model_config_from_hf({**LLAMA31_8B, **change}, "x/config.json")


@pytest.mark.parametrize(
    "released, change, message",
    [
        (QWEN3_0_6B, {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        (QWEN3_0_6B, {"layer_types": ["full_attention"] * 27 + ["sliding_attention"]},
         "layer_types ['full_attention', 'sliding_attention'] is not supported"),
        (QWEN3_0_6B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
         "does not describe a supported model: Value error, rope_scaling: rope_type yarn is not computed by arch qwen3"),
        (QWEN3_0_6B, {"attention_bias": True}, "attention_bias=True is not supported"),
        (QWEN3_30B_A3B, {"mlp_only_layers": [0, 2, 3]},
         "mlp_only_layers (with decoder_sparse_step 1) is not a regular every-N-th-layer pattern"),
        (QWEN3_30B_A3B, {"num_experts": None}, "num_experts is missing"),
    ],
)
def test_qwen3_config_refusals(released, change, message):
    """What Qwen3 models could say but ours do not compute is refused, naming the file and the field."""
    config = {key: value for key, value in {**released, **change}.items() if key not in change or value is not None}
    with pytest.raises(UserError) as refused:
        model_config_from_hf(config, "x/config.json")
    assert str(refused.value).startswith(f"x/config.json: {message}")


def test_irregular_llama4_layer_patterns_are_refused():
    with pytest.raises(UserError, match="moe_layers is not a regular"):
        model_config_from_hf({**LLAMA4_SCOUT_TEXT, "moe_layers": [0, 5]})
    with pytest.raises(UserError, match="no_rope_layers is not a regular"):
        model_config_from_hf({**LLAMA4_SCOUT_TEXT, "no_rope_layers": [1, 0, 0] + [1] * 45})


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe", "tiny_qwen3", "tiny_qwen3_moe"])
def test_mapping_names_cover_the_hf_model(preset, tmp_path):
    """Our HF names are the tensors transformers writes (save_pretrained): no lm_head.weight when tied (tiny_qwen3),
    one tensor per expert for Qwen3-MoE (held fused in transformers-5's memory); MoE presets with dense layers too."""
    cfg = model_cfg(preset)
    cfg = cfg.model_copy(update={"moe_layer_interval": 2}) if cfg.is_moe else cfg
    AutoModelForCausalLM.from_config(hf_config(cfg)).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as written:
        assert sorted(mapping.hf_parameter_names(cfg)) == sorted(written.keys())


@pytest.mark.parametrize("preset", PRESETS)
def test_rope_frequencies_match_transformers(preset):
    cfg = model_cfg(preset)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(cfg))
    torch.testing.assert_close(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), expected)


def test_qkv_fusion_groups_queries_with_their_key_value_head():
    cfg = model_cfg("tiny_dense").model_copy(update=dict(hidden_size=2, num_attention_heads=4, num_query_groups=2,
                                                          head_dim=1))
    q = torch.tensor([[0.0, 0], [1, 1], [2, 2], [3, 3]])  # heads 0,1 -> group 0; heads 2,3 -> group 1
    k = torch.tensor([[10.0, 10], [11, 11]])
    v = torch.tensor([[20.0, 20], [21, 21]])
    fused = mapping.fuse_qkv(q, k, v, cfg)
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    for original, back in zip((q, k, v), mapping.split_qkv(fused, cfg), strict=True):
        assert torch.equal(original, back)


@pytest.mark.parametrize("split", ["none", "dim0", "dim1", "glu"])
def test_shard_unshard_round_trip(split):
    rule = mapping.TensorRule("x", ("y",), split=split)
    full = torch.arange(48.0).reshape(8, 6)
    shards = [mapping.shard(rule, full, rank, 2) for rank in range(2)]
    assert torch.equal(mapping.unshard(rule, shards), full)
    if split == "glu":  # each rank: its half of the gate rows, then its half of the up rows
        assert torch.equal(shards[1], torch.cat([full[2:4], full[6:8]]))


def test_hf_to_megatron_state_places_experts_and_shards():
    cfg = model_cfg("tiny_moe").model_copy(update={"moe_layer_interval": 2})
    hf_state = AutoModelForCausalLM.from_config(hf_config(cfg)).state_dict()
    ranks = RankLayout(tp_rank=1, tp_size=2, etp_rank=0, etp_size=1, ep_rank=1, ep_size=2, layers=range(2, 4),
                       first_stage=False, last_stage=True)
    state = hf_to_megatron_state(hf_state, cfg, ranks)
    experts = cfg.num_experts // 2
    # layer 3 (global) is the stage's second layer; this EP rank holds experts 2 and 3 as local 0 and 1.
    gate_up = hf_state["model.layers.3.feed_forward.experts.gate_up_proj"]
    assert torch.equal(state["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"], gate_up[3].t())
    assert "decoder.layers.0.mlp.linear_fc1.weight" in state  # layer 2 is dense
    assert "embedding.word_embeddings.weight" not in state and "output_layer.weight" in state
    lm_head = hf_state["lm_head.weight"]
    assert torch.equal(state["output_layer.weight"], lm_head[lm_head.shape[0] // 2 :])
    o_proj = hf_state["model.layers.2.self_attn.o_proj.weight"]
    assert torch.equal(state["decoder.layers.0.self_attention.linear_proj.weight"], o_proj[:, o_proj.shape[1] // 2 :])
    assert sum(".local_experts." in name for name in state) == 2 * experts  # fc1 + fc2 per local expert, one layer


def test_missing_hf_tensor_is_named():
    cfg = model_cfg("tiny_dense")
    ranks = RankLayout(0, 1, 0, 1, 0, 1, range(cfg.num_layers), True, True)
    with pytest.raises(KeyError, match="HF weights lack model.embed_tokens.weight"):
        hf_to_megatron_state({}, cfg, ranks)


def test_layout_refusals_name_the_field():
    moe = model_cfg("tiny_moe")
    with pytest.raises(UserError, match="sequence_parallel"):
        check_model_layout(moe, ParallelismConfig(tp=2))
    with pytest.raises(UserError, match="parallelism.ep: ep=3 does not divide model.num_experts=4"):
        check_model_layout(moe, ParallelismConfig(ep=3))
    with pytest.raises(UserError, match="parallelism.tp: tp=4 does not divide model.num_query_groups=2"):
        check_model_layout(model_cfg("tiny_dense"), ParallelismConfig(tp=4))


def _causal_attention(q, k, v, mask):
    """q, k, v [s, b, h, d]; mask [s, s] bool (True = may attend) -> [s, b, h*d]."""
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).flatten(2)


@pytest.mark.parametrize("seq_len", [5, 8, 19])
def test_chunk_folding_equals_chunked_causal_mask(seq_len):
    chunk = 4
    q, k, v = (torch.randn(seq_len, 2, 3, 8) for _ in range(3))
    i = torch.arange(seq_len)
    chunked_mask = (i[None, :] <= i[:, None]) & (i[None, :] // chunk == i[:, None] // chunk)  # HF chunked_overlay
    expected = _causal_attention(q, k, v, chunked_mask)
    causal = torch.ones(chunk, chunk).tril().bool()
    folded = _causal_attention(fold_chunks(q, chunk), fold_chunks(k, chunk), fold_chunks(v, chunk), causal)
    torch.testing.assert_close(unfold_chunks(folded, seq_len, 2), expected)


def test_temperature_scales_follow_hf_formula():
    scales = temperature_scales(20, floor_scale=8.0, attn_scale=0.1, device=torch.device("cpu"))
    positions = torch.arange(20.0)
    torch.testing.assert_close(scales, torch.log1p(torch.floor((positions + 1.0) / 8.0)) * 0.1 + 1.0)
    assert scales[6] == 1.0 and scales[7] > 1.0


@pytest.mark.parametrize("preset,tp,ep,etp", [("tiny_dense", 2, 1, 1), ("tiny_qwen3", 2, 1, 1),
                                              ("tiny_moe", 2, 2, 1), ("tiny_moe", 1, 2, 2),
                                              ("tiny_qwen3_moe", 2, 2, 2)])
def test_hf_slices_of_every_rank_tile_every_hf_tensor_once(preset, tp, ep, etp, tmp_path):
    """What weight sync sends without gathering (`hf_slices`, each rank its own shard's slices of HF tensors),
    assembled as the generators assemble it (`protocol.Assembler`), is the HF checkpoint bit for bit (oracle: the
    checkpoint transformers made), over every TP / expert-TP / EP rank of a stage; the vocabulary padding never
    travels."""
    from megatron_scalerl.models.weights import _exported_rules
    from megatron_scalerl.weight_sync.protocol import Assembler, Bucket, Piece

    cfg = model_cfg(preset)
    cfg = cfg.model_copy(update={"moe_layer_interval": 2}) if cfg.is_moe else cfg
    AutoModelForCausalLM.from_config(hf_config(cfg)).save_pretrained(tmp_path)
    hf_state = load_file(tmp_path / "model.safetensors")
    assembler, done = Assembler(), {}
    experts_per_rank = cfg.num_experts // ep if cfg.is_moe else 0
    for tp_rank in range(tp):
        for ep_rank in range(ep):
            for etp_rank in range(etp):
                ranks = RankLayout(tp_rank, tp, etp_rank, etp, ep_rank, ep, range(cfg.num_layers), True, True)
                state = hf_to_megatron_state(hf_state, cfg, ranks)
                pieces = []
                for rule, layer, local in _exported_rules(cfg, ranks):
                    if rule.is_expert and tp_rank or not rule.is_expert and (ep_rank or etp_rank):
                        continue  # one sender per shard (the TP group's, the expert group's)
                    rank, size = ranks.split_of(rule)
                    for local_expert in range(experts_per_rank) if rule.is_expert else (None,):
                        expert = None if local_expert is None else ep_rank * experts_per_rank + local_expert
                        shard_ = state[mapping.megatron_name(rule, local, local_expert)]
                        for piece in mapping.hf_slices(rule, shard_, cfg, rank=rank, size=size, expert=expert):
                            pieces.append(Piece(piece.name.format(layer=layer), piece.tensor, piece.full_shape,
                                                piece.start))
                if not pieces:
                    continue
                bucket = Bucket.pack(0, pieces)
                for name, tensor in assembler.add(bucket.header(), bucket.packed):
                    assert name not in done, f"{name} completed twice"
                    done[name] = tensor
    assert assembler.incomplete() == []
    assert sorted(done) == sorted(hf_state)
    for name, tensor in done.items():
        assert torch.equal(tensor, hf_state[name]), name
