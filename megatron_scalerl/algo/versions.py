"""The policy version, one type everywhere: an `int`, the trainer's optimizer steps (docs/design.md, section 3).

Version v is the policy after v optimizer steps (`StepState.step`); the trainer tags the weights it sends after step
v with v. Every process holds a version as an int >= 0, and `NO_VERSION` (-1) wherever there is none: a prompt token,
a forced interruption-phrase token, a server's start-up weights (vLLM's "default", before the first update), a
server that does not answer. The rollout stream stores the same -1 for prompt tokens (`weight_versions`, int64).

On the wire vLLM keeps a version as a string: `version_tag` is what the trainer sends on `/finish_weight_update`,
`parse_version` reads it back from `/weight_info` and from the per-token weight-version spans of a generation.
"""

from __future__ import annotations

NO_VERSION = -1
LOST_TAG = "lost"  # what a restart of the trainer tags the live generators' weights with: a lost policy's
# (parse_version: NO_VERSION), so whatever version they serve next came from the restarted trainer


def version_tag(version: int) -> str:
    """The string `version` travels as on `/finish_weight_update` (vLLM's `weight_version`)."""
    if version < 0:
        raise ValueError(f"policy version {version}: a pushed version is an optimizer step count, >= 0")
    return str(version)


def parse_version(tag: str | None) -> int:
    """The policy version of vLLM's `weight_version` string: the int of a `version_tag`; NO_VERSION for its
    start-up weights ("default"), for None (no tag) and for any tag the trainer did not send."""
    return int(tag) if isinstance(tag, str) and tag.isascii() and tag.isdigit() else NO_VERSION
