"""The recipe's cross-field rules: what no single field can check on its own (layout vs model, budgets vs lengths).

Each rule names the field a user should change. Units as in recipe/schema.py: tokens, GPUs, samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_scalerl import families

if TYPE_CHECKING:
    from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, Recipe


def layout_problems(m: ModelConfig, p: ParallelismConfig) -> list[tuple[str, str]]:
    """Whether the model can be split as `p` says (the rules every converter and the trainer share)."""
    out: list[tuple[str, str]] = []
    expert_tp = p.expert_tp_size
    # No vocab_size rule: the embedding and LM head are padded to a multiple of lcm(128, tp)
    # (models.mapping.padded_vocab_size).
    for field, size in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups),
                        ("ffn_hidden_size", m.ffn_hidden_size)):
        if size % p.tp:
            out.append(("parallelism.tp", f"tp={p.tp} does not divide model.{field}={size}"))
    if m.num_layers % p.pp:
        out.append(("parallelism.pp", f"pp={p.pp} does not divide model.num_layers={m.num_layers}"))
    if p.ep > 1 and not m.is_moe:
        out.append(("parallelism.ep", f"ep={p.ep} needs an MoE model (model.num_experts is 0)"))
    if m.is_moe:
        if m.num_experts % p.ep:
            out.append(("parallelism.ep", f"ep={p.ep} does not divide model.num_experts={m.num_experts}"))
        if m.moe_ffn_hidden_size % max(p.tp, expert_tp):
            out.append(("parallelism.expert_tp", f"tp={p.tp} / expert_tp={expert_tp} does not divide "
                                                 f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}"))
        if p.tp > 1 and not p.sequence_parallel:
            out.append(("parallelism.sequence_parallel", f"MoE with tp={p.tp} > 1 needs sequence_parallel: true"))
    elif p.tp > 1 and not p.sequence_parallel and families.layer_plan(m, 0).latent_attention:
        # its shared RoPE key's gradient is summed over TP by the sequence gather (platform/layer_backend.py)
        out.append(("parallelism.sequence_parallel",
                    f"multi-latent attention with tp={p.tp} > 1 needs sequence_parallel: true"))
    return out


def cross_field_problems(r: Recipe) -> list[tuple[str, str]]:
    """Every rule the recipe breaks, as (dotted path, reason) pairs, in a stable order (validate raises the first)."""
    m, p, a, ro, c = r.model, r.parallelism, r.algorithm, r.rollout, r.cluster
    out = layout_problems(m, p)
    trainer_gpus = c.trainer_gpus
    if trainer_gpus % (p.tp * p.pp):
        out.append(("parallelism", f"tp*pp={p.tp * p.pp} does not divide the {trainer_gpus} trainer GPUs "
                                   f"(cluster.trainer_nodes x cluster.gpus_per_node)"))
    elif p.dp is not None and p.tp * p.pp * p.dp != trainer_gpus:
        out.append(("parallelism.dp", f"tp*pp*dp={p.tp * p.pp * p.dp} != {trainer_gpus} trainer GPUs"))
    if c.generator_gpus % p.generator_tp:
        out.append(("parallelism.generator_tp", f"generator_tp={p.generator_tp} does not divide the "
                                                f"{c.generator_gpus} generator GPUs (cluster.generator_nodes x "
                                                f"cluster.gpus_per_node)"))
    elif p.generator_tp % c.gpus_per_node and c.gpus_per_node % p.generator_tp:
        out.append(("parallelism.generator_tp", f"generator_tp={p.generator_tp} neither divides "
                                                f"cluster.gpus_per_node={c.gpus_per_node} (servers within a node) nor "
                                                "is a multiple of it (a server spanning whole nodes)"))
    dp = p.dp_size(trainer_gpus)
    expert_tp = p.expert_tp_size
    if m.is_moe and (p.tp * dp) % (p.ep * expert_tp):
        out.append(("parallelism.ep", f"ep*expert_tp={p.ep * expert_tp} does not divide tp*dp={p.tp * dp}"))
    if ro.max_prompt_tokens + ro.max_new_tokens > m.max_position_embeddings:
        out.append(("rollout.max_new_tokens",
                    f"max_prompt_tokens + max_new_tokens = {ro.max_prompt_tokens + ro.max_new_tokens} exceeds "
                    f"model.max_position_embeddings={m.max_position_embeddings}"))
    lc = a.length_control
    if lc.mode == "interruption":
        if lc.think_budget_min > lc.think_budget_max:
            out.append(("algorithm.length_control.think_budget_min",
                        f"{lc.think_budget_min} > think_budget_max {lc.think_budget_max}"))
        if not lc.interruption_phrase.strip():
            out.append(("algorithm.length_control.interruption_phrase", "must not be empty"))
        need = lc.think_budget_max + lc.phrase_token_reserve + lc.answer_budget
        if need > ro.max_new_tokens:
            out.append(("algorithm.length_control.think_budget_max",
                        f"think_budget_max + phrase_token_reserve + answer_budget = {need} exceeds "
                        f"rollout.max_new_tokens={ro.max_new_tokens}"))
        if need > r.eval.max_new_tokens:  # the eval watcher samples with the same interruption
            out.append(("eval.max_new_tokens", f"think_budget_max + phrase_token_reserve + answer_budget = {need} "
                                               f"exceeds eval.max_new_tokens={r.eval.max_new_tokens}"))
        unthinking = [f"data.train[{i}]" for i, source in enumerate(r.data.train) if not source.thinking]
        unthinking += [f"eval.benchmarks ({b.name})" for b in r.eval.benchmarks if not isinstance(b, str)
                       and not b.thinking]
        if unthinking:
            out.append(("algorithm.length_control.mode",
                        f"interruption forces the end of a thinking block, and {', '.join(unthinking)} "
                        "set thinking: false (their replies have none): use length_penalty or none"))
    if lc.mode == "length_penalty":
        if lc.penalty_cache_len >= lc.penalty_max_len:
            out.append(("algorithm.length_control.penalty_cache_len",
                        f"{lc.penalty_cache_len} must be < penalty_max_len {lc.penalty_max_len}"))
        if lc.penalty_max_len > ro.max_new_tokens:
            out.append(("algorithm.length_control.penalty_max_len",
                        f"{lc.penalty_max_len} exceeds rollout.max_new_tokens={ro.max_new_tokens}"))
    if a.loss.type == "ppo_clip" and a.loss.clip_low != a.loss.clip_high:
        out.append(("algorithm.loss.clip_high", f"ppo_clip is the symmetric clip: clip_high {a.loss.clip_high} != "
                                                f"clip_low {a.loss.clip_low} (use loss dapo for clip-higher)"))
    if a.routing_replay and not m.is_moe:
        out.append(("algorithm.routing_replay", "needs an MoE model (model.num_experts is 0): a dense model has no "
                                                "routing to replay"))
    if ro.capture_routes and not m.is_moe:
        out.append(("rollout.capture_routes", "needs an MoE model (model.num_experts is 0): a dense model has no "
                                              "routing to capture"))
    if a.reward_correct <= a.reward_incorrect:
        out.append(("algorithm.reward_correct", "must be greater than algorithm.reward_incorrect"))
    f = r.forecast
    if f.stop_at_fraction is not None and not (f.live and f.resamples > 0 and r.data.validation_holdout > 0):
        out.append(("forecast.stop_at_fraction", "needs the live forecast with an interval on A: forecast.live true, "
                                                 "forecast.resamples > 0 and data.validation_holdout > 0"))
    return out
