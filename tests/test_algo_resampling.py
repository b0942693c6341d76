"""No-Positive-Resampling: the three history rules, permanent retirement, JSON save/restore, determinism."""

from __future__ import annotations

import json

import pytest

from megatron_scalerl.algo.resampling import NoPositiveResampling
from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import load_recipe


def make(history: str, threshold: float = 0.75, ema_decay: float = 0.5, enabled: bool = True):
    return NoPositiveResampling(threshold=threshold, history=history, ema_decay=ema_decay, enabled=enabled)


def test_latest_rule_retires_on_the_latest_pass_rate_and_for_good():
    npr = make("latest")
    assert npr.record("p1", 11, 16) is False  # 0.6875 < 0.75
    assert npr.record("p1", 12, 16) is True  # 0.75 >= 0.75
    assert npr.record("p1", 0, 16) is True  # retired prompts stay retired
    assert npr.pass_rate("p1") == 0.0 and npr.retired == frozenset({"p1"})
    assert npr.pass_rate("never-seen") is None


def test_cumulative_rule_pools_all_samples():
    npr = make("cumulative", threshold=0.8)
    npr.record("p", 8, 16)
    assert npr.record("p", 16, 16) is False  # 24 / 32 = 0.75
    assert npr.record("p", 16, 16) is True  # 40 / 48 = 0.833
    assert npr.pass_rate("p") == pytest.approx(40 / 48)


def test_ema_rule():
    npr = make("ema", threshold=0.8, ema_decay=0.5)
    npr.record("p", 8, 16)  # e1 = 0.5
    assert npr.record("p", 16, 16) is False  # e2 = 0.5 * 0.5 + 0.5 * 1 = 0.75
    assert npr.pass_rate("p") == pytest.approx(0.75)
    assert npr.record("p", 16, 16) is True  # e3 = 0.875


def test_disabled_keeps_history_but_retires_nothing():
    npr = make("latest", enabled=False)
    assert npr.record("p", 16, 16) is False
    assert npr.pass_rate("p") == 1.0 and not npr.retired
    assert npr.active(["q", "p", "r"]) == ["q", "p", "r"]


def test_active_filters_retired_prompts_in_order():
    npr = make("latest")
    npr.record("b", 16, 16)
    npr.record("d", 16, 16)
    npr.record("a", 1, 16)
    assert npr.active(["a", "b", "c", "d", "e"]) == ["a", "c", "e"]
    assert npr.metrics() == {"npr_retired_prompts": 2.0, "npr_seen_prompts": 3.0}


def events(count: int):
    """A deterministic stream of (prompt, correct, samples) groups."""
    return [(f"prompt-{(7 * k) % 13}", (5 * k) % 17, 16) for k in range(count)]


@pytest.mark.parametrize("history", ["latest", "cumulative", "ema"])
def test_save_restore_continues_exactly_like_the_uninterrupted_run(tmp_path, history):
    stream = events(60)
    straight = make(history, threshold=0.7)
    for e in stream:
        straight.record(*e)
    first = make(history, threshold=0.7)
    for e in stream[:25]:
        first.record(*e)
    first.save(tmp_path / "npr.json")
    resumed = make(history, threshold=0.7)
    resumed.load(tmp_path / "npr.json")
    assert resumed.state_dict() == first.state_dict()
    for e in stream[25:]:
        resumed.record(*e)
    assert resumed.retired == straight.retired and len(straight.retired) > 0
    straight.save(tmp_path / "a.json")
    resumed.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_load_errors_name_the_file_and_field(tmp_path):
    npr = make("latest")
    with pytest.raises(UserError, match="missing.json: cannot read"):
        npr.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bad.json: invalid JSON"):
        npr.load(tmp_path / "bad.json")
    other = make("latest", threshold=0.9)
    other.record("p", 16, 16)
    other.save(tmp_path / "other.json")
    with pytest.raises(UserError, match=r"other.json: saved no_positive_resampling.threshold=0.9 differs .* 0.75"):
        npr.load(tmp_path / "other.json")
    state = json.loads((tmp_path / "other.json").read_text())
    del state["prompts"]
    (tmp_path / "broken.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match="broken.json: malformed state"):
        make("latest", threshold=0.9).load(tmp_path / "broken.json")


def test_from_recipe_config_and_bad_input():
    npr = NoPositiveResampling.from_config(load_recipe("scalerl").algorithm.no_positive_resampling)
    assert (npr.threshold, npr.history, npr.enabled) == (0.9, "latest", True)
    with pytest.raises(UserError, match="unknown rule 'mean'"):
        make("mean")
    with pytest.raises(ValueError, match="num_correct"):
        npr.record("p", 17, 16)
