"""Transformers' warning about Llama-4 Scout's own RoPE scaling: said once per run, not once per process.

Scout's `rope_scaling` has `low_freq_factor == high_freq_factor` (1.0). transformers warns "`rope_parameters`'s
high_freq_factor field must be greater than low_freq_factor" each time it reads such a config, and every process of
a run reads it (the launcher, each trainer rank, the orchestrator, each vLLM process). The values are valid for the
llama3 formula: no band of wavelengths lies between the two bounds, so none is smoothed, and our models compute what
transformers computes with them.

The launcher states it once (`note_once`, which also sets SCALERL_ROPE_NOTE_SAID=1 for the roles it starts); a
process that has that variable drops that one message (`quiet_if_said`: a filter on transformers' rope logger,
nothing else). Our processes call it as they start (the `scalerl` command, the trainer's and the orchestrator's
`__main__`); vLLM's through the `vllm.general_plugins` entry point in pyproject.toml (a `VLLM_PLUGINS` list that
leaves it out skips it: vLLM's processes then repeat the warning). Outside a launch (e.g. `scalerl verify`)
transformers' warning is left as it is.
"""

from __future__ import annotations

import logging
import os

SAID_ENV = "SCALERL_ROPE_NOTE_SAID"
TRANSFORMERS_LOGGER = "transformers.modeling_rope_utils"
MESSAGE_START = "`rope_parameters`'s high_freq_factor field must be greater than low_freq_factor"


class _DropRopeNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(MESSAGE_START)


def degenerate(rope_scaling) -> bool:
    """Whether a llama3 `rope_scaling` (recipe `RopeScaling` or None) is Scout's kind: high_freq_factor equal to
    low_freq_factor (high < low is a misconfiguration: transformers' warning about it is left alone)."""
    return (rope_scaling is not None and rope_scaling.low_freq_factor is not None  # llama3's field (not YaRN's)
            and rope_scaling.high_freq_factor == rope_scaling.low_freq_factor)


def note_once(rope_scaling, env: dict[str, str] | None = None) -> str | None:
    """The launcher's one line about a degenerate `rope_scaling` (None for any other, or when `env` says it was said
    already); marks `env` (default: this process's environment, which the roles inherit) so the run's processes
    stay quiet about it."""
    env = os.environ if env is None else env
    if not degenerate(rope_scaling) or env.get(SAID_ENV) == "1":
        return None
    env[SAID_ENV] = "1"
    quiet_if_said(env)
    return (f"note: the model's rope_scaling has high_freq_factor {rope_scaling.high_freq_factor} = "
            f"low_freq_factor {rope_scaling.low_freq_factor} (as Llama-4 Scout's): valid, no frequency band is "
            "smoothed; transformers' warning about it is shown here once instead of by every process")


def quiet_if_said(env: dict[str, str] | None = None) -> None:
    """In a process of a run whose launcher gave the note (`env`, default this process's environment, says so):
    drop transformers' warning about it in this process (idempotent)."""
    if (os.environ if env is None else env).get(SAID_ENV) != "1":
        return
    logger = logging.getLogger(TRANSFORMERS_LOGGER)
    if not any(isinstance(f, _DropRopeNote) for f in logger.filters):
        logger.addFilter(_DropRopeNote())
