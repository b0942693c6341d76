"""The off-policy modes' one definition: admission's staleness bound and the trainer's push schedule agree."""

import pytest

from megatron_scalerl.algo.off_policy import last_push_step, next_push_step, pushes_weights_after, staleness_bound


@pytest.mark.parametrize("k", [1, 2, 8])
def test_pipeline_pushes_every_step_and_admits_k_ahead(k):
    assert staleness_bound("pipeline", k) == k
    assert all(pushes_weights_after("pipeline", k, s) for s in range(1, 20))


@pytest.mark.parametrize("k", [1, 2, 8])
def test_ppo_freezes_one_policy_for_k_batches(k):
    """PPO-off-policy-k: weights after steps k, 2k, ...; batches b = jk ... jk + k - 1 come from the policy of step
    jk, so a token is at most k - 1 steps stale: exactly the admission bound."""
    assert staleness_bound("ppo", k) == k - 1
    pushed = [s for s in range(1, 5 * k + 1) if pushes_weights_after("ppo", k, s)]
    assert pushed == [k * j for j in range(1, 6)]
    for b in range(5 * k):
        policy = max([0] + [s for s in pushed if s <= b])
        assert b - policy <= staleness_bound("ppo", k)


def test_the_last_push_is_the_schedules():
    assert [last_push_step("pipeline", 4, s) for s in range(6)] == list(range(6))
    assert [last_push_step("ppo", 4, s) for s in range(10)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    assert all(pushes_weights_after("ppo", 4, last_push_step("ppo", 4, s)) for s in range(4, 20))
    assert pushes_weights_after("ppo", 4, 6, last_step=6) and not pushes_weights_after("ppo", 4, 5, last_step=6)


def test_the_next_push_is_the_first_version_served_from_a_step_on():
    assert [next_push_step("pipeline", 4, s, 9) for s in range(11)] == [*range(10), 9]
    assert [next_push_step("ppo", 4, s, 9) for s in range(11)] == [0, 4, 4, 4, 4, 8, 8, 8, 8, 9, 9]
    assert all(pushes_weights_after("ppo", 4, next_push_step("ppo", 4, s, 9), last_step=9) for s in range(10))


def test_unknown_modes_are_refused():
    with pytest.raises(ValueError, match="off-policy mode 'sync'"):
        staleness_bound("sync", 2)
    with pytest.raises(ValueError, match="k >= 1"):
        pushes_weights_after("ppo", 0, 3)
