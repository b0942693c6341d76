"""No-Positive-Resampling: prompts that the policy (almost) always solves leave later epochs (paper section 2).

Every finished generation group reports its prompt's pass rate (correct samples / samples). Per prompt we keep the
latest pass rate, the cumulative counts and an exponential moving average, so the state does not depend on the rule.
The rule (recipe: algorithm.no_positive_resampling.history) turns them into one number:

    latest      the pass rate of the prompt's most recent group
    cumulative  all correct samples / all samples of the prompt so far
    ema         e_k = ema_decay * e_{k-1} + (1 - ema_decay) * p_k, starting from e_1 = p_1

A prompt whose number reaches `threshold` is retired for good: the prompt sampler skips it from then on. With
`enabled` false the history is still kept (for metrics) but nothing is retired.

The state is plain data; `save` writes it as JSON (sorted keys, atomic) for checkpoints and `load` restores it, so a
resumed run retires exactly the prompts the uninterrupted run would have. Prompt ids are strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_text
from megatron_scalerl.recipe.schema import HistoryRule

STATE_VERSION = 1


@dataclass
class PromptHistory:
    """One prompt's pass-rate history. Counts are samples; rates are fractions in [0, 1]."""

    latest: float
    correct: int
    samples: int
    ema: float
    groups: int  # generation groups recorded


class NoPositiveResampling:
    def __init__(self, *, threshold: float, history: str, ema_decay: float, enabled: bool = True):
        if history not in get_args(HistoryRule):
            raise UserError(f"no_positive_resampling.history: unknown rule '{history}' "
                            f"(known: {', '.join(get_args(HistoryRule))})")
        if not 0 <= threshold <= 1 or not 0 <= ema_decay <= 1:
            raise UserError(f"no_positive_resampling: threshold {threshold} and ema_decay {ema_decay} must be in "
                            "[0, 1]")
        self.threshold = threshold
        self.history = history
        self.ema_decay = ema_decay
        self.enabled = enabled
        self._prompts: dict[str, PromptHistory] = {}
        self._retired: set[str] = set()

    @classmethod
    def from_config(cls, config: Any) -> NoPositiveResampling:
        """From a recipe's NoPositiveResamplingConfig (algorithm.no_positive_resampling)."""
        return cls(threshold=config.threshold, history=config.history, ema_decay=config.ema_decay,
                   enabled=config.enabled)

    def record(self, prompt_id: str, num_correct: int, num_samples: int) -> bool:
        """Add one finished group of `prompt_id`; return whether the prompt is retired after it."""
        if num_samples <= 0 or not 0 <= num_correct <= num_samples:
            raise ValueError(f"prompt {prompt_id}: need 0 <= num_correct ({num_correct}) <= num_samples "
                             f"({num_samples}) and num_samples > 0")
        rate = num_correct / num_samples
        past = self._prompts.get(prompt_id)
        if past is None:
            self._prompts[prompt_id] = PromptHistory(latest=rate, correct=num_correct, samples=num_samples, ema=rate,
                                                     groups=1)
        else:
            past.latest = rate
            past.correct += num_correct
            past.samples += num_samples
            past.ema = self.ema_decay * past.ema + (1 - self.ema_decay) * rate
            past.groups += 1
        if self.enabled and self.pass_rate(prompt_id) >= self.threshold:
            self._retired.add(prompt_id)
        return prompt_id in self._retired

    def pass_rate(self, prompt_id: str) -> float | None:
        """The rule's pass rate of `prompt_id`, or None if it has no history."""
        past = self._prompts.get(prompt_id)
        if past is None:
            return None
        if self.history == "latest":
            return past.latest
        if self.history == "cumulative":
            return past.correct / past.samples
        return past.ema

    @property
    def retired(self) -> frozenset[str]:
        return frozenset(self._retired)

    def active(self, prompt_ids: Iterable[str]) -> list[str]:
        """The prompts of `prompt_ids` that are not retired, in their order."""
        return [p for p in prompt_ids if p not in self._retired]

    def metrics(self) -> dict[str, float]:
        return {"npr_retired_prompts": float(len(self._retired)), "npr_seen_prompts": float(len(self._prompts))}

    # -- checkpoint state ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "settings": {"threshold": self.threshold, "history": self.history, "ema_decay": self.ema_decay,
                         "enabled": self.enabled},
            "prompts": {pid: asdict(h) for pid, h in sorted(self._prompts.items())},
            "retired": sorted(self._retired),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "no-positive-resampling state") -> None:
        """Restore a `state_dict`; the saved settings must equal this instance's (a changed rule is an error)."""
        try:
            if state["version"] != STATE_VERSION:
                raise UserError(f"{source}: version {state['version']} is not {STATE_VERSION}")
            mine = self.state_dict()["settings"]
            for key, mine_value in mine.items():
                if state["settings"][key] != mine_value:
                    raise UserError(f"{source}: saved no_positive_resampling.{key}={state['settings'][key]!r} "
                                    f"differs from the recipe's {mine_value!r}")
            prompts = {str(pid): PromptHistory(**fields) for pid, fields in state["prompts"].items()}
            retired = {str(pid) for pid in state["retired"]}
        except (KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{source}: malformed state ({type(exc).__name__}: {exc})") from None
        unknown = retired - set(prompts)
        if unknown:
            raise UserError(f"{source}: retired prompt {sorted(unknown)[0]!r} has no history")
        self._prompts, self._retired = prompts, retired

    def save(self, path: str | os.PathLike) -> None:
        """Write the state as JSON, atomically (deterministic bytes for equal states)."""
        atomic_write_text(path, json.dumps(self.state_dict(), indent=1, sort_keys=True) + "\n")

    def load(self, path: str | os.PathLike) -> None:
        path = Path(path)
        try:
            state = json.loads(path.read_text())
        except OSError as exc:
            raise UserError(f"{path}: cannot read: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON: {exc}") from None
        if not isinstance(state, dict):
            raise UserError(f"{path}: expected a JSON object, got {type(state).__name__}")
        self.load_state_dict(state, source=str(path))
