"""The recipe's RL math as pure tensor code: no process groups, no servers (paper section 2).

    losses.py          policy_loss over a registry (cispo, tis_reinforce, ppo_clip, dapo, gspo)
    aggregation.py     prompt / sample / token aggregation; LossNormalizers for split invariance
    advantages.py      group baseline + batch / prompt / no normalisation
    filters.py         zero-variance groups, truncated samples (keep / mask / drop)
    resampling.py      No-Positive-Resampling history and retired prompts
    length_control.py  forced interruption (its two-request flow), length penalty, truncation accounting
    versions.py        the policy version: an int, NO_VERSION, vLLM's weight_version strings
"""

from megatron_scalerl.algo.advantages import StepAdvantages, group_baseline, normalise, step_advantages
from megatron_scalerl.algo.aggregation import LossNormalizers
from megatron_scalerl.algo.filters import SampleSelection, select_samples, zero_variance_samples
from megatron_scalerl.algo.length_control import (
    Continuation,
    InterruptionPolicy,
    join_segments,
    length_metrics,
    length_penalty,
)
from megatron_scalerl.algo.losses import LOSSES, loss_params, merge_metrics, policy_loss
from megatron_scalerl.algo.resampling import NoPositiveResampling
from megatron_scalerl.choices import AGGREGATIONS

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "Continuation",
    "InterruptionPolicy",
    "LossNormalizers",
    "NoPositiveResampling",
    "SampleSelection",
    "StepAdvantages",
    "group_baseline",
    "join_segments",
    "length_metrics",
    "length_penalty",
    "loss_params",
    "merge_metrics",
    "normalise",
    "policy_loss",
    "select_samples",
    "step_advantages",
    "zero_variance_samples",
]
