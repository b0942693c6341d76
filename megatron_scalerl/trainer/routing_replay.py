"""MoE routing replay (R3): the trainer's routers use the experts the generator chose, through megatron's RouterReplay.

A TrainBatch may carry `routes` (uint8 [T, n_moe_layers, top_k], `batches.train_batch`): per token, the global
expert ids the generator's router chose at each MoE layer. `trainer.microbatches` packs them into micro-batch rows
exactly like the input tokens ([rows, seq, n_moe_layers, top_k]; padding positions get valid ids). `RoutingReplay`
hands them to megatron-core's per-layer `RouterReplay` instances (`moe_enable_routing_replay`, on in every MoE
model's config: `models.config`) around each micro-batch's forward pass:

- before the forward: each MoE layer of this rank's pipeline stage gets its column of the routes, in the router's
  token order ([seq(/tp), rows] flattened: Megatron's [s, b] layout, this rank's sequence-parallel slice), keyed by
  the router's global layer number (`router.layer_number`, 1-based) mapped to the MoE layers' order
  (`config.moe_layer_freq`). megatron's `RouterReplay.set_replay_data` addresses instances by creation order over
  the whole process instead, which breaks once a process builds a second model; the per-layer
  `set_target_indices` it calls is used directly;
- replay on (`algorithm.routing_replay`): action REPLAY_FORWARD. The router then uses the given top-k and gathers
  its own scores at those experts (`scores.gather`), so the gate still gets its gradient through the replayed
  experts' scores; megatron queues each target for recomputation. With softmax routing (Qwen3-MoE) the scores
  gathered are the logits, softmaxed over the k (`moe_router_pre_softmax` false: HF's `norm_topk_prob`, a softmax
  renormalised over the chosen experts), or the softmax over all experts (pre-softmax true: unnormalised). The k
  weights are scattered into [tokens, experts], so the order of a token's k ids does not matter;
- after the forward: action REPLAY_BACKWARD, so activation recomputation (`parallelism.recompute: full`) replays
  the same targets in backward (each layer pops its queue first in, first out: megatron's schedules run the
  backward passes in the order of the forward passes); without recomputation the queue is dropped at once.
- replay off but routes present: action RECORD (megatron records the router's own top-k; nothing is replayed), so
  the agreement below is still measured.

`train/routing_agreement` (`figures`): the fraction of (token, MoE layer) pairs whose top-k expert SET chosen by the
trainer's own router (order ignored) equals the generator's, over every input token of the step's batch (prompt and
completion tokens alike, as the trainer runs them: each sample's tokens but its last; padding excluded), every MoE
layer and every rank's share. Under replay megatron skips the router's own top-k, so `OwnChoiceRouterReplay` computes
it from the same scores (a top-k over num_experts scores per token). Under replay a layer's own choice is taken on
hidden states that earlier layers computed with the replayed routes, so the figure counts per-layer disagreement;
without replay a flip also changes what the later layers see.

Load-balancing losses: our Llama-4 family has none (`moe_router_load_balancing_type: none`), Qwen3-MoE's is off
unless `model.moe_aux_loss_coeff` is set. With one, megatron-core computes the aux loss from the router's full scores
and its own top-k (`compute_routing_scores_for_aux_loss`, independent of the replayed indices), so under replay it
still pushes the gate toward balanced own choices, while the experts train on the generator's; the same holds for a
z-loss. An expert-bias (aux-loss-free) update counts the replayed routing map instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_scalerl.batches.train_batch import BatchError, TrainBatch, routes_problem
from megatron_scalerl.models.weights import unwrap_model
from megatron_scalerl.trainer.microbatches import MicroBatch


class OwnChoiceRouterReplay(RouterReplay):
    """megatron's RouterReplay for one MoE layer which, when it replays (REPLAY_FORWARD), also records the top-k its
    router would have chosen (what megatron's RECORD action records; its replay skips computing it)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """scores: [tokens, num_experts] routing scores; returns (probs [tokens, topk], indices [tokens, topk])."""
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                self.record_indices(default_compute_topk(scores.detach(), topk, num_groups, group_topk)[1])
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


def topk_sets_agree(own: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: whether each token's set of expert ids in `own` [tokens, k] equals its set in `target`
    [tokens, k] (the order within the k ids is ignored)."""
    return (own.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)


class RoutingReplay:
    """This rank's MoE routers (their `OwnChoiceRouterReplay`, keyed by global MoE layer index) and the step's
    agreement counts. Per step: `begin(batch)`, then `before_forward` / `after_forward` around each micro-batch's
    forward pass, `end()` (always), and `figures()` (collective). A no-op for a batch without routes."""

    def __init__(self, model_chunks: list, *, replay: bool, sequence_parallel: bool, tp_rank: int, tp_size: int,
                 device: torch.device):
        config = unwrap_model(model_chunks[0]).config
        # global 0-based layer numbers of the model's MoE layers (moe_layer_freq is a 0/1 list: models/config.py)
        moe_layers = [i for i, moe in enumerate(config.moe_layer_freq) if moe] if config.num_moe_experts else []
        if moe_layers and config.moe_router_fusion:
            raise ValueError("routing replay needs megatron's unfused router (moe_router_fusion off): the fused "
                             "top-k skips RouterReplay")
        self.replay = replay
        self.num_moe_layers, self.top_k = len(moe_layers), config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self.recomputes = config.recompute_granularity is not None
        self.sequence_parallel, self.tp_rank, self.tp_size = sequence_parallel, tp_rank, tp_size
        self.counts = sequence_parallel or tp_rank == 0  # without sequence parallelism TP peers see the same tokens
        self.layers: dict[int, OwnChoiceRouterReplay] = {}
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self.layers[moe_layers.index(module.layer_number - 1)] = _own_choice_replay(module)
        self.tally = torch.zeros(2, dtype=torch.float64, device=device)  # [agreeing pairs, pairs]
        self.targets: dict[int, torch.Tensor] = {}  # the current micro-batch's routes per MoE layer, [tokens, k]
        self.active = False

    def begin(self, batch: TrainBatch) -> None:
        """Start a pass over `batch`: check its routes against the model (BatchError naming the field), zero the
        counts. With replay on, an MoE model's batch must carry routes."""
        routes = batch.routes
        if routes is None and self.replay and self.num_moe_layers:
            raise BatchError("TrainBatch: routes: algorithm.routing_replay is on but the batch has none (the "
                             "generators did not return each token's experts; a batch written before replay was "
                             "turned on has none either)")
        if routes is not None:
            expected = (self.num_moe_layers, self.top_k)
            problem = routes_problem(routes, batch.num_tokens, self.num_experts)
            if problem is None and tuple(routes.shape[1:]) != expected:
                problem = (f"shape {tuple(routes.shape)}, but the model has {expected[0]} MoE layers with top-"
                           f"{expected[1]} routing: [T, {expected[0]}, {expected[1]}] expected")
            if problem:
                raise BatchError(f"TrainBatch: routes: {problem}")
        self.active = routes is not None
        self.tally.zero_()

    def before_forward(self, mb: MicroBatch) -> None:
        """Give each of this rank's MoE layers its column of `mb.routes` and the step's action."""
        if not self.active:
            return
        for index, layer in self.layers.items():
            target = self._router_order(mb.routes[:, :, index, :]).long()  # [tokens, k]
            self.targets[index] = target
            if self.replay:
                layer.set_target_indices(target)
            layer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD if self.replay
                                           else RouterReplayAction.RECORD)

    def after_forward(self, mb: MicroBatch) -> None:
        """Count the micro-batch's agreement, then leave each layer ready for its recomputation in backward."""
        if not self.active:
            return
        real = self._router_order(mb.input_mask)  # [tokens] bool
        for index, layer in self.layers.items():
            if self.counts:
                agree = topk_sets_agree(layer.get_recorded_indices(), self.targets[index]) & real
                self.tally += torch.stack([agree.sum(), real.sum()]).to(self.tally.dtype)
            layer.record_indices(None)
            if self.replay and self.recomputes and torch.is_grad_enabled():  # a training pass that recomputes
                layer.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                layer.replay_backward_list.clear()
                layer.clear_router_replay_action()
        self.targets.clear()

    def end(self) -> None:
        """Leave every layer as built (no action, no targets), whatever happened in the pass."""
        for layer in self.layers.values():
            layer.clear_indices()
            layer.clear_router_replay_action()
        self.targets.clear()

    def figures(self) -> dict[str, float]:
        """Collective (every rank, after a pass over a batch): {"routing_agreement": fraction} summed over ranks;
        {} for a batch without routes."""
        if not self.active:
            return {}
        tally = self.tally.clone()
        if dist.is_initialized():
            dist.all_reduce(tally)
        return {"routing_agreement": float(tally[0] / tally[1])} if tally[1] > 0 else {}

    def _router_order(self, per_position: torch.Tensor) -> torch.Tensor:
        """[rows, seq, ...] -> [tokens, ...] in the order the router sees this rank's tokens: Megatron's [seq, rows]
        flattened, this rank's 1/tp of the sequence under sequence parallelism."""
        by_seq = per_position.transpose(0, 1)
        if self.sequence_parallel:
            share = by_seq.shape[0] // self.tp_size
            by_seq = by_seq[self.tp_rank * share:(self.tp_rank + 1) * share]
        return by_seq.flatten(0, 1)


def _own_choice_replay(router: TopKRouter) -> OwnChoiceRouterReplay:
    """Give `router` an OwnChoiceRouterReplay in place of the RouterReplay megatron built for it (dropped from
    megatron's process-wide list, which this module does not use)."""
    if router.router_replay is None:
        raise ValueError("the model's config has moe_enable_routing_replay off: its routers cannot replay")
    if router.router_replay in RouterReplay.global_router_replay_instances:
        RouterReplay.global_router_replay_instances.remove(router.router_replay)
    router.router_replay = OwnChoiceRouterReplay()
    return router.router_replay
