"""A test hook inside a vLLM worker (`worker_extension.scalerl_permute_experts`): every MoE router sends expert e's
tokens to p[e] instead, so a test can alter routing inside the server and see the routes come back altered."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner


def _permuted(router, table: torch.Tensor):
    """`router._compute_routing(hidden_states, router_logits, ...)` whose expert ids e become table[e], each
    weighted by the router's own score of its new expert: the router's own routing on logits [tokens, experts] kept
    at the new experts and -inf elsewhere (its score function, whatever it is: top-k then softmax, sigmoid,
    Llama-4's), rescaled for a softmax over all experts without renormalisation (vLLM's `Default`, Qwen3-MoE with
    norm_topk_prob false), whose scores depend on the other experts' logits as well. Returns (weights [tokens, k]
    float, ids [tokens, k]) in the router's order."""
    compute_routing = router._compute_routing  # the class's own (bound): `permute_experts` removed ours first
    over_all = (getattr(router, "scoring_func", None) == "softmax" and not getattr(router, "renormalize", True)
                and getattr(router, "custom_routing_function", None) is None)

    def permuted(hidden_states, router_logits, *args, **kwargs):
        _, own = compute_routing(hidden_states, router_logits, *args, **kwargs)
        ids = table.to(own.device)[own.long()]
        kept = torch.full_like(router_logits, float("-inf")).scatter(1, ids, router_logits.gather(1, ids))
        weights, chosen = compute_routing(hidden_states, kept, *args, **kwargs)
        if not torch.equal(chosen.long().sort(dim=-1).values, ids.sort(dim=-1).values):
            raise RuntimeError(f"permute_experts: {type(router).__name__} did not choose the permuted experts from "
                               "their own logits (grouped top-k or a score bias): the hook cannot permute it")
        if over_all:
            weights = weights * torch.softmax(router_logits.float(), dim=-1).gather(1, ids).sum(-1, keepdim=True)
        return weights, chosen

    return permuted


def permute_experts(model: torch.nn.Module, permutation: list[int] | None) -> int:
    """Test hook: every MoE router of `model` sends the tokens it routes to expert e to `permutation[e]` instead,
    weighted by its own score of that expert: the routing a trainer replaying the routes computes (megatron's replay
    gathers the router's scores at the replayed experts; with a renormalised softmax, a softmax over the replayed
    experts' logits). `None` restores its own routing. Captures (ours and vLLM's) see the permuted ids, the experts
    compute them. Any router that scores each expert from the logits alone (vLLM's routers of Llama-4, Qwen3-MoE
    and the like, top-k > 1 included; see `_permuted`). Returns the routers changed. Python-level: on a CUDA server
    it needs eager mode (a captured CUDA graph replays the routing it was captured with)."""
    routers = [module.router for module in model.modules() if isinstance(module, MoERunner)]
    if not routers:
        raise RuntimeError("permute_experts: the model has no MoE router")
    for router in routers:
        router.__dict__.pop("_compute_routing", None)  # the class's own again
        if permutation is None:
            continue
        if sorted(permutation) != list(range(router.global_num_experts)):
            raise ValueError(f"permute_experts: {permutation} is not a permutation of the "
                             f"{router.global_num_experts} experts")
        router._compute_routing = _permuted(router, torch.tensor(permutation))
    return len(routers)
