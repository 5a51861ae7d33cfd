"""The guard's policy (memd/guard.py), without sockets: whom to cut, and when."""
import pytest

from memd import config
from memd.guard import STREAK, decisive, next_streaks, to_cut


def test_only_connections_receiving_without_delivering_count_up():
    streaks = {10: 0, 11: 1, 12: 3}
    # 10 received and delivered nothing; 11 delivered a message; 12 was silent this look
    assert next_streaks(streaks, active={10, 11}, delivered={11}) == {10: 1, 11: 0, 12: 3}


def test_silence_does_not_forgive_an_unfinished_message():
    """A peer pausing between frames still holds its message: only a delivery resets it."""
    streaks = {10: 0}
    for active in ({10}, set(), {10}, set()):
        streaks = next_streaks(streaks, active=active, delivered=set())
    assert streaks == {10: 2}


def test_nobody_is_cut_under_the_memory_limit():
    assert to_cut({10: 50}, rss=100, limit=100) == []
    assert to_cut({10: 50}, rss=None, limit=100) == []  # no /proc: no limit
    assert to_cut({10: 50}, rss=200, limit=None) == []


def test_over_the_limit_a_message_in_passing_is_spared():
    """One look with bytes and no message yet can be a request arriving: it takes STREAK."""
    assert to_cut({10: STREAK - 1, 11: STREAK, 12: STREAK + 5, 13: 0}, rss=101, limit=100) == [11, 12]


def test_a_daemon_behind_on_its_queue_does_not_take_waiting_messages_for_streams():
    """Whole messages waiting their turn look like bytes received and nothing delivered: a look
    decides only once the server emptied its socket or took a full round of messages since."""
    assert decisive(caught_up=True, received=0, connections=300)
    assert not decisive(caught_up=False, received=48, connections=300)  # 10 ms of reports at 256 sessions
    assert decisive(caught_up=False, received=300, connections=300)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_max_connections_is_checked(value):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"MEMD_MAX_CONNECTIONS": value})
    assert "max_connections" in str(err.value) and "MEMD_MAX_CONNECTIONS" in str(err.value)
