"""The names a recipe may choose among for the RL algorithm, in one place: `recipe/schema.py` types its fields with them
and `algo/` builds its registries from them, so the two cannot disagree. Plain tuples, no imports (the recipe loads
without torch)."""

LOSSES = ("cispo", "ppo_clip", "dapo", "gspo", "tis_reinforce")  # algo.losses.LOSSES: one LossSpec each
AGGREGATIONS = ("prompt", "sample", "token")  # algo.aggregation
ADVANTAGE_NORMS = ("batch", "prompt", "none")  # algo.advantages
TRUNCATED_POLICIES = ("keep", "mask", "drop")  # algo.filters: samples that hit the hard length cap
HISTORY_RULES = ("latest", "cumulative", "ema")  # algo.resampling: No-Positive-Resampling pass-rate history
