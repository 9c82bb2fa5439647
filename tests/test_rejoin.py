"""Hosts that come back (issue 52), the policy alone: each lost host asked again with a back-off, taken back once it
passes, and one that flaps (lost again soon after it came back) kept out longer each time, up to the ceiling. The
runs themselves (a host taken back; one that flaps) are in test_backup_copy.py, on SSH hosts with disks of their
own."""

from launcher.run.rejoin import FLAP_WINDOW_S, PROBE_FIRST_S, PROBE_MAX_S, Absences


def test_a_lost_host_is_asked_again_with_a_back_off_and_is_ready_once_it_passes():
    a = Absences(cooldown=60.0, cooldown_max=240.0)
    assert a.lost(1, now=0.0) == 0.0  # lost the first time: no cooldown
    assert a.due(PROBE_FIRST_S - 0.1) == [] and a.due(PROBE_FIRST_S) == [1]
    waits, now = [], PROBE_FIRST_S
    for _ in range(10):
        assert a.looked(1, "connection refused", now) is False
        waits.append(a.absent[1].next_look - now)
        now = a.absent[1].next_look
    assert waits[:3] == [PROBE_FIRST_S, 2 * PROBE_FIRST_S, 4 * PROBE_FIRST_S] and max(waits) == PROBE_MAX_S
    assert a.ready() == [] and a.looked(1, None, now) is True and a.ready() == [1] and a.due(now + 1e6) == []


def test_a_host_that_flaps_is_kept_out_twice_as_long_each_time_up_to_the_ceiling():
    a = Absences(cooldown=60.0, cooldown_max=200.0)
    now, kept = 0.0, []
    a.lost(2, now)
    for _ in range(4):  # comes back, then is lost again soon after
        a.looked(2, None, now)
        a.back([2], now)
        now += 30.0
        kept.append(a.lost(2, now))
        assert a.due(now + kept[-1] - 0.1) == [] and a.due(now + max(kept[-1], PROBE_FIRST_S)) == [2]
    assert kept == [60.0, 120.0, 200.0, 200.0]
    a.looked(2, None, now)
    a.back([2], now)
    now += FLAP_WINDOW_S + 1
    assert a.lost(2, now) == 0.0  # lost long after it came back: no flap, no cooldown, and forgiven
    a.looked(2, None, now)
    a.back([2], now)
    assert a.lost(2, now + 1.0) == 60.0  # its next flap starts again at the first cooldown
