"""Build the megatron-core GPTModel for a recipe's model (any model family: `families/`), at the current layout.

    from megatron_scalerl.models import build_model
    model = build_model(recipe.model, recipe.parallelism, fp32_lm_head=recipe.trainer.fp32_lm_head,
                        params_dtype=torch.bfloat16)
    logits = model(input_ids, position_ids, attention_mask=None)   # [b, s, padded_vocab / tp], this rank's shard

The embedding and output layer have `mapping.padded_vocab_size(vocab_size, tp)` rows (any vocabulary at any TP);
the output layer (`output_layer.OutputLayer`) returns -inf logits in the padding columns (global index >= vocab_size),
so they drop out of every softmax and their rows get no gradient. Gather the logits over TP and keep
[..., :vocab_size] to compare with HF.

Call after `platform.initialize_model_parallel(...)` with the same layout. `pre_process` / `post_process` default to
this rank's pipeline position (first stage embeds, last stage has the final norm and output layer). Weights are
megatron's random init (same seed -> same weights on every layout) until `load_hf_state` fills them.
For bf16 training wrap the model in megatron's `Float16Module` as usual: the FP32 head keeps its FP32 weights (a tied
embedding too: it is the head's weight, `output_layer.adopt_tied_embedding`).
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_scalerl.models.config import transformer_config
from megatron_scalerl.models.layer_specs import decoder_block_spec
from megatron_scalerl.models.mapping import padded_vocab_size
from megatron_scalerl.models.output_layer import adopt_output_layer, adopt_tied_embedding
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] (fp32, radians per token), with Llama-3 frequency scaling.

    Llama-3 scaling keeps wavelengths shorter than original_max / high_freq_factor, divides those longer than
    original_max / low_freq_factor by `factor`, and interpolates smoothly in between (HF rope_type "llama3").
    megatron-core's own scaling hard-codes low/high factors 1 and 4 and the original length 8192, which Llama-4
    (high_freq_factor 1) and our tiny presets (original length 256) do not use.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    if scaling.high_freq_factor != scaling.low_freq_factor:
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        scaled = torch.where(medium, smoothed, scaled)
    return scaled


def build_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelismConfig,
    *,
    fp32_lm_head: bool,
    params_dtype: torch.dtype = torch.float32,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
) -> GPTModel:
    """A GPTModel holding this rank's shard of `model_cfg` (TP/PP/EP as in `parallel_cfg`)."""
    config = transformer_config(model_cfg, parallel_cfg, params_dtype=params_dtype)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(model_cfg, config, pp_rank=pp_rank, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(model_cfg.vocab_size, parallel_cfg.tp),
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=model_cfg.rope_theta,
        vp_stage=vp_stage,
    )
    if not config.multi_latent_attention:  # MLA's layers keep their own RoPE (plain or YaRN, megatron-core's)
        inv_freq = rope_inv_freq(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.rope_scaling)
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    adopt_output_layer(model, fp32=fp32_lm_head, vocab_size=model_cfg.vocab_size)
    if fp32_lm_head and model_cfg.tie_word_embeddings:  # the embedding is the head: FP32 too
        adopt_tied_embedding(model, body_dtype=params_dtype)
    return model
