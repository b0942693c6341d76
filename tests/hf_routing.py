"""transformers' MoE routers as the reference of the routing tests (tests/test_routing_capture.py,
tests/test_routing_replay.py): found through the family's weight table (the HF name of its router rule), their logits
recorded, their experts optionally forced, each weighted as that HF router scores its experts.

HF's routers differ by family in what they return: Llama-4's `Llama4Router` (top-k of the logits, a sigmoid of the
chosen ones: (scores [tokens, experts], logits)) and Qwen3-MoE's `Qwen3MoeTopKRouter` (a softmax over all experts,
the top-k, renormalised over them when `norm_topk_prob`: (logits, weights [tokens, k], ids [tokens, k])). A forced
router keeps its family's scoring at the experts it is given; that is what megatron's replay computes (it gathers
the router's scores at the replayed experts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from megatron_scalerl.models.mapping import hf_names, layer_rules, router_rule
from megatron_scalerl.recipe import ModelConfig

ROUTER = router_rule("").megatron  # the Megatron name every family's router rule has


def hf_routers(model: torch.nn.Module, model_cfg: ModelConfig) -> list[torch.nn.Module]:
    """The router modules of the HF `model`'s MoE layers, in layer order: the modules the family's router rule
    names (its HF weight's module)."""
    names = [hf_names(rule, layer)[0] for layer in range(model_cfg.num_layers)
             for rule in layer_rules(model_cfg, layer) if rule.megatron == ROUTER]
    assert names, f"{model_cfg.arch}: no router rule in the family's weight table"
    return [model.get_submodule(name.removesuffix(".weight")) for name in names]


def _llama4(router, logits: Tensor, ids: Tensor):
    scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, logits.gather(1, ids))
    return torch.sigmoid(scores.float()).to(scores.dtype), logits


def _qwen3_moe(router, logits: Tensor, ids: Tensor):
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


# HF router class -> (its output for experts `ids` [tokens, k] given its logits [tokens, experts])
_OUTPUTS: dict[str, Callable] = {"Llama4Router": _llama4, "Qwen3MoeTopKRouter": _qwen3_moe}


@contextlib.contextmanager
def routed(model: torch.nn.Module, model_cfg: ModelConfig,
           choose: Callable[[int, Tensor], Tensor] | None = None) -> Iterator[list[Tensor]]:
    """Within: every MoE router of the HF `model` records its logits (the yielded list gets one [tokens, experts]
    tensor per router call, in call order: per forward, the MoE layers in order) and routes each token to
    `choose(moe_index, logits)` ([tokens, k] int64 ids), weighted as its family scores those experts; without
    `choose` it routes as its own forward does."""
    routers = hf_routers(model, model_cfg)
    logits_seen: list[Tensor] = []

    def forward(index: int, router, hidden_states: Tensor):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.weight.shape[1]), router.weight)
        logits_seen.append(logits)
        if choose is None:
            return type(router).forward(router, hidden_states)
        return _OUTPUTS[type(router).__name__](router, logits, choose(index, logits))

    for index, router in enumerate(routers):
        router.forward = lambda hidden_states, index=index, router=router: forward(index, router, hidden_states)
    try:
        yield logits_seen
    finally:
        for router in routers:
            del router.forward
