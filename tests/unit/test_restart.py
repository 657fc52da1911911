"""The restart policy: when a dead part starts again (backoff), when it stays down (the bound), and "no"."""

from __future__ import annotations

import pytest

from pdkv.deploy.run.restart import RestartPolicy, Verdict, describe_exit


def test_backoff_doubles_from_one_second_up_to_the_cap() -> None:
    policy = RestartPolicy(initial_s=1.0, max_s=30.0, burst=100, window_s=60.0)
    now = 0.0
    delays = []
    for _ in range(7):
        decision = policy.exited(now, -9)
        assert decision.verdict is Verdict.RESTART
        delays.append(decision.delay_s)
        now += decision.delay_s + 2.0  # dies 2 s after each restart
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert policy.restarts == 7


def test_more_than_burst_exits_in_the_window_gives_up() -> None:
    policy = RestartPolicy(burst=5, window_s=60.0)
    verdicts = [policy.exited(float(t), 1).verdict for t in range(6)]  # six exits within 6 s
    assert verdicts == [Verdict.RESTART] * 5 + [Verdict.GIVE_UP]
    decision = policy.exited(7.0, 1)
    assert decision.verdict is Verdict.GIVE_UP and "stays down" in decision.why


def test_exits_older_than_the_window_do_not_count_toward_the_bound() -> None:
    policy = RestartPolicy(burst=2, window_s=60.0)
    assert policy.exited(0.0, 1).verdict is Verdict.RESTART
    assert policy.exited(30.0, 1).verdict is Verdict.RESTART
    assert policy.exited(61.0, 1).verdict is Verdict.RESTART  # the exit at 0 s has left the window
    assert policy.exited(62.0, 1).verdict is Verdict.GIVE_UP  # 30, 61, 62: three within 60 s


def test_a_part_that_ran_long_enough_starts_the_backoff_again() -> None:
    policy = RestartPolicy(initial_s=1.0, reset_after_s=300.0, burst=100)
    assert policy.exited(0.0, 1).delay_s == 1.0
    assert policy.exited(10.0, 1).delay_s == 2.0
    assert policy.exited(20.0, 1).delay_s == 4.0  # restarted at 24 s
    assert policy.exited(24.0 + 299.0, 1).delay_s == 8.0  # ran 299 s: not yet long enough
    assert policy.exited(331.0 + 300.0, 1).delay_s == 1.0  # ran 300 s after the restart due at 331 s


def test_restart_no_never_restarts() -> None:
    policy = RestartPolicy("no")
    decision = policy.exited(0.0, -9)
    assert decision.verdict is Verdict.NO_RESTART
    assert decision.why == 'killed by SIGKILL; restart = "no"'
    assert policy.failed(1.0, "was not healthy in time").verdict is Verdict.NO_RESTART


def test_a_server_that_exits_cleanly_on_its_own_is_restarted() -> None:
    # vLLM's API server exits 0 once its engine core has died: the service is gone all the same
    decision = RestartPolicy().exited(0.0, 0)
    assert decision.verdict is Verdict.RESTART and decision.why == "exited with code 0; restart 1 in 1 s"


def test_a_start_that_never_became_healthy_counts_as_a_failure() -> None:
    policy = RestartPolicy(burst=1)
    first = policy.failed(0.0, "was not healthy after 900 s")
    assert first.verdict is Verdict.RESTART and first.why.startswith("was not healthy after 900 s; restart 1 in 1 s")
    assert policy.failed(5.0, "was not healthy after 900 s").verdict is Verdict.GIVE_UP


@pytest.mark.parametrize(
    ("code", "words"), [(1, "exited with code 1"), (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (-200, "killed by signal 200")]
)
def test_exit_codes_in_words(code: int, words: str) -> None:
    assert describe_exit(code) == words


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="restart mode"):
        RestartPolicy("always")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RestartPolicy(initial_s=10.0, max_s=1.0)
