"""What to change when a layout does not fit (`scalerl recipe show --plan`): changes of one or two layout settings,
each checked by the recipe's rules (`recipe.rules.cross_field_problems`) and planned again (`memory_plan`). Pure
arithmetic, like the plan itself.

Trainer knobs, each one step from the recipe's value: full recomputation (activations: only each layer's input is
kept), tp x 2 with sequence parallelism (dense weights and activations split further), pp x 2 (layers split),
ep x 2 (routed experts split), half the micro-batch, twice the trainer nodes (the distributed optimizer shards
over twice the data-parallel ranks); tensor parallelism within a node. Generator: weight sync through the hosts
(`weight_sync.transport=gloo`) where the NCCL communicators of the sending trainer ranks are what does not fit, else
the least generator_tp (x 2, x 4, ..., within a node first, then whole nodes: a server spanning nodes) that fits. A change names what `--set` takes, e.g. `parallelism.recompute=full`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from megatron_scalerl.models.memory_plan import (
    NCCL_PART,
    VLLM_GPU_MEMORY_UTILIZATION,
    MemoryPlan,
    generator_plan,
    kv_sequences,
    trainer_plan,
    weight_sync_senders,
)
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.recipe.rules import cross_field_problems
from megatron_scalerl.recipe.variants import BroadcastTransportConfig

MAX_CHANGES = 4  # at most this many changes that fit are reported


@dataclass(frozen=True)
class Change:
    """A change of the recipe (`--set KEY=VALUE` each) and the per-GPU plan total it gives (GiB)."""

    settings: tuple[str, ...]
    why: str
    total_gib: float
    fits: bool

    def as_dict(self) -> dict:
        return {"set": list(self.settings), "why": self.why, "total_gib": self.total_gib, "fits": self.fits}


# recipe -> (the change's settings by dotted path, what it shrinks), or None where the knob does not apply
_Knob = Callable[[Recipe], tuple[dict[str, object], str] | None]


def _recompute(r: Recipe) -> tuple[dict[str, object], str] | None:
    if r.parallelism.recompute == "full":
        return None
    return {"parallelism.recompute": "full"}, "activations: keeps only each layer's input"


def _tp(r: Recipe) -> tuple[dict[str, object], str] | None:
    p = r.parallelism
    if p.tp * 2 > r.cluster.gpus_per_node:  # tensor parallelism stays within a node
        return None
    settings: dict[str, object] = {"parallelism.tp": p.tp * 2, "parallelism.sequence_parallel": True}
    if r.model.is_moe:  # the experts stay split as they are (expert TP follows tp when unset)
        settings["parallelism.expert_tp"] = p.expert_tp_size
    return settings, "splits dense weights and activations over twice the tensor-parallel ranks"


def _pp(r: Recipe) -> tuple[dict[str, object], str] | None:
    return {"parallelism.pp": r.parallelism.pp * 2}, "splits the layers over twice the pipeline stages"


def _ep(r: Recipe) -> tuple[dict[str, object], str] | None:
    if not r.model.is_moe:
        return None
    return {"parallelism.ep": r.parallelism.ep * 2}, "splits the routed experts over twice the expert-parallel ranks"


def _nodes(r: Recipe) -> tuple[dict[str, object], str] | None:
    return ({"cluster.trainer_nodes": r.cluster.trainer_nodes * 2},
            "shards the optimizer over twice the data-parallel ranks")


def _micro_batch(r: Recipe) -> tuple[dict[str, object], str] | None:
    mbs = r.parallelism.micro_batch_size
    return None if mbs == 1 else ({"parallelism.micro_batch_size": mbs // 2}, "halves the activations in flight")


# the order changes are reported in: those that keep the GPU count first, more trainer GPUs last
TRAINER_KNOBS: tuple[_Knob, ...] = (_recompute, _tp, _pp, _ep, _micro_batch, _nodes)


def _with(r: Recipe, settings: dict[str, object]) -> Recipe:
    """`r` with `settings` (dotted paths) applied and dp left to be derived (not checked)."""
    sections: dict[str, dict[str, object]] = {"parallelism": {"dp": None}}
    for path, value in settings.items():
        section, field = path.split(".")
        sections.setdefault(section, {})[field] = value
    return r.model_copy(update={name: getattr(r, name).model_copy(update=fields) for name, fields in sections.items()})


def _changed(r: Recipe, settings: dict[str, object]) -> Recipe | None:
    """`r` with `settings` applied; None when the recipe's rules refuse the result."""
    changed = _with(r, settings)
    return None if cross_field_problems(changed) else changed


def _apply(recipe: Recipe, knobs: tuple[_Knob, ...], plan: Callable[[Recipe], MemoryPlan],
           usable_gib: float) -> Change | None:
    """The knobs turned one after the other, planned; None when one does not apply or the rules refuse the result."""
    settings: dict[str, object] = {}
    why: list[str] = []
    for knob in knobs:
        step = knob(_with(recipe, settings))
        if step is None:
            return None
        settings.update(step[0])
        why.append(step[1])
    if (changed := _changed(recipe, settings)) is None:
        return None
    dp = changed.parallelism.dp_size(changed.cluster.trainer_gpus)
    if dp != recipe.parallelism.dp_size(recipe.cluster.trainer_gpus):  # a recipe that sets dp must change it too
        settings["parallelism.dp"] = dp
    total = plan(changed).total_gib
    return Change(tuple(f"{k}={_yaml(v)}" for k, v in settings.items()), "; ".join(why), total, total <= usable_gib)


def _changes(recipe: Recipe, knobs: tuple[_Knob, ...], plan: Callable[[Recipe], MemoryPlan],
             usable_gib: float) -> list[Change]:
    """The changes of one knob that fit, in the knobs' order; when none does, those of two knobs; when none of those
    does either, the single change and the pair that come closest."""
    closest: list[Change] = []
    for n in (1, 2):
        tried = [c for group in combinations(knobs, n) if (c := _apply(recipe, group, plan, usable_gib))]
        fitting = [c for c in tried if c.fits]
        if fitting:
            return fitting[:MAX_CHANGES]
        closest += sorted(tried, key=lambda c: c.total_gib)[:1]
    return closest


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def trainer_changes(recipe: Recipe, gpu_gib: float) -> list[Change]:
    """Layout changes after which the trainer fits GPUs of `gpu_gib` GiB (one knob, else two); none when it fits."""
    if trainer_plan(recipe).fits(gpu_gib):
        return []
    return _changes(recipe, TRAINER_KNOBS, trainer_plan, gpu_gib)


def generator_changes(recipe: Recipe, gpu_gib: float) -> list[Change]:
    """The least generator_tp after which a generator fits GPUs of `gpu_gib` GiB (vLLM's gpu_memory_utilization of
    them), or the largest when none fits; none when it fits already or generator_tp takes every generator GPU. Past
    `cluster.gpus_per_node` a server spans nodes (tensor parallelism over the network: slower per token)."""
    usable = gpu_gib * VLLM_GPU_MEMORY_UTILIZATION
    plan = generator_plan(recipe)
    if plan.fits(usable):
        return []
    if NCCL_PART in plan.beside:  # every generator GPU joins each sender's group: the communicators may be the cause
        hosts = _changed(recipe, {"weight_sync.transport": BroadcastTransportConfig(type="gloo")})
        total = generator_plan(hosts).total_gib if hosts is not None else None
        if total is not None and total <= usable:
            return [Change(("weight_sync.transport=gloo",), f"weight sync through the hosts: no NCCL communicator of "
                           f"each of the {weight_sync_senders(recipe)} sending trainer ranks on every generator GPU "
                           "(slower syncs)", total, True)]
    tp, change = recipe.parallelism.generator_tp, None
    while tp * 2 <= recipe.cluster.generator_gpus and not (change and change.fits):
        tp *= 2
        changed = _changed(recipe, {"parallelism.generator_tp": tp})
        if changed is not None:  # generator_tp divides the generator GPUs
            total = generator_plan(changed).total_gib
            nodes = changed.generator_server_nodes
            where = f"{tp} GPUs" + (f", a server spanning {nodes} nodes" if nodes > 1 else "")
            change = Change((f"parallelism.generator_tp={tp}",), f"splits the served weights and KV cache over "
                            f"{where}", total, total <= usable)
    return [change] if change else []


def kv_change(recipe: Recipe, gpu_gib: float) -> tuple[str, int, int] | None:
    """When a generator holds fewer full-length sequences than its share of a step's samples: the least
    generator_tp within a node that holds them all, as (setting, sequences it holds, its share); else None."""
    tp = recipe.parallelism.generator_tp
    if kv_sequences(recipe, gpu_gib) >= _share(recipe):
        return None
    while tp * 2 <= recipe.cluster.gpus_per_node:  # past a node, fewer servers: each one's share grows as fast
        tp *= 2
        changed = _changed(recipe, {"parallelism.generator_tp": tp})
        if changed is not None and kv_sequences(changed, gpu_gib) >= _share(changed):
            return f"parallelism.generator_tp={tp}", kv_sequences(changed, gpu_gib), _share(changed)
    return None


def _share(recipe: Recipe) -> int:
    """A server's share of a step's samples (all generated at once when the KV cache holds them)."""
    return -(-recipe.samples_per_step // recipe.generator_servers)
