"""The policy version: an int on our side, vLLM's weight_version string on the wire, NO_VERSION where there is none."""

import pytest

from megatron_scalerl.algo.versions import NO_VERSION, parse_version, version_tag


def test_a_pushed_version_reads_back_as_itself():
    assert [parse_version(version_tag(v)) for v in (0, 1, 12345)] == [0, 1, 12345]


def test_start_up_weights_and_foreign_tags_have_no_version():
    assert NO_VERSION == -1  # the rollout stream's prompt-token value (weight_versions int64)
    assert [parse_version(tag) for tag in ("default", None, "", "-3", "1.5", "v2", "\u00b2")] == [NO_VERSION] * 7


def test_only_trained_versions_are_pushed():
    with pytest.raises(ValueError, match="policy version -1"):
        version_tag(NO_VERSION)
