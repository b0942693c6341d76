"""Which layers are what, and which layouts fit, from the recipe's `ModelConfig` alone (no megatron-core import; converters use it).

Layer indices are global and 0-based. Hugging Face Llama-4 conventions:
  MoE layers:  `moe_layers = range(interleave_moe_layer_step - 1, num_layers, step)`
  NoPE layers: every `no_rope_layer_interval`-th layer (1-based) has no RoPE and attends globally.
"""

from __future__ import annotations

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig


def is_moe_layer(model_cfg: ModelConfig, layer: int) -> bool:
    return model_cfg.is_moe and (layer + 1) % model_cfg.moe_layer_interval == 0


def is_rope_layer(model_cfg: ModelConfig, layer: int) -> bool:
    interval = model_cfg.nope_layer_interval
    return interval is None or (layer + 1) % interval != 0


def check_model_layout(model_cfg: ModelConfig, parallel_cfg: ParallelismConfig) -> None:
    """Refuse layouts the model cannot be split into, naming the field."""
    tp, ep = parallel_cfg.tp, parallel_cfg.ep
    etp = parallel_cfg.expert_tp or tp
    if model_cfg.num_query_groups % tp:
        raise UserError(f"parallelism.tp: {tp} does not divide model.num_query_groups {model_cfg.num_query_groups}")
    if model_cfg.vocab_size % tp:
        raise UserError(f"parallelism.tp: {tp} does not divide model.vocab_size {model_cfg.vocab_size}")
    if model_cfg.ffn_hidden_size % tp:
        raise UserError(f"parallelism.tp: {tp} does not divide model.ffn_hidden_size {model_cfg.ffn_hidden_size}")
    if model_cfg.num_layers % parallel_cfg.pp:
        raise UserError(f"parallelism.pp: {parallel_cfg.pp} does not divide model.num_layers {model_cfg.num_layers}")
    if not model_cfg.is_moe and ep > 1:
        raise UserError("parallelism.ep: expert parallelism needs a MoE model (model.num_experts > 0)")
    if model_cfg.is_moe:
        if model_cfg.num_experts % ep:
            raise UserError(f"parallelism.ep: {ep} does not divide model.num_experts {model_cfg.num_experts}")
        assert model_cfg.moe_ffn_hidden_size is not None
        if model_cfg.moe_ffn_hidden_size % max(etp, tp):
            raise UserError("parallelism: tp or expert_tp does not divide model.moe_ffn_hidden_size")
        if tp > 1 and not parallel_cfg.sequence_parallel:
            raise UserError("parallelism.sequence_parallel: MoE with tp > 1 needs sequence_parallel: true")
        if model_cfg.moe_router_topk != 1:
            raise UserError("model.moe_router_topk: Llama-4 routing applies the score to the expert input; only 1")
