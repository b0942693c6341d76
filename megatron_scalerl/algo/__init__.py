"""The recipe's RL math as pure tensor code: no process groups, no servers (paper section 2). Import the modules
themselves (`from megatron_scalerl.algo.losses import policy_loss`): this file imports nothing, so light processes
read `algo.versions` without torch.

    losses.py          policy_loss over a registry (cispo, tis_reinforce, ppo_clip, dapo, gspo)
    aggregation.py     prompt / sample / token aggregation; LossNormalizers for split invariance
    advantages.py      group baseline + batch / prompt / no normalisation
    filters.py         zero-variance groups, truncated samples (keep / mask / drop)
    resampling.py      No-Positive-Resampling history and retired prompts
    length_control.py  forced interruption (its two-request flow), length penalty, truncation accounting
    versions.py        the policy version: an int, NO_VERSION, vLLM's weight_version strings
"""
