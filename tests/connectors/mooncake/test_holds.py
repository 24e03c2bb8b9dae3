"""The prefill's hold table: releases, leases, renewals and tokens."""

from __future__ import annotations

import pytest

from connectors.mooncake.holds import HoldTable
from tests.helpers.clock import Clock
from tests.helpers.mooncake_wire import KEY, OTHER, TOKEN, issued

pytestmark = pytest.mark.unit


def test_hold_released_only_when_every_decode_worker_is_done():
    clock = Clock()
    table = HoldTable(timeout_s=30, clock=clock)
    table.hold("r", 30, TOKEN)
    table.release("r", "decode/pp0/tp0", num_consumers=2, token=TOKEN)
    assert table.pop_finished() == (set(), set()) and len(table) == 1
    table.release("r", "decode/pp0/tp0", num_consumers=2, token=TOKEN)  # a repeated notice does not count twice
    assert table.pop_finished() == (set(), set())
    table.release("r", "decode/pp0/tp1", num_consumers=2, token=TOKEN)
    assert table.pop_finished() == ({"r"}, set()) and len(table) == 0


def test_initial_lease_lapses_and_early_notice_is_kept():
    clock = Clock()
    table = HoldTable(timeout_s=5, clock=clock, key=KEY)
    table.hold("orphan", 5, TOKEN)
    fast = issued("fast")
    table.release("fast", "d", 1, fast)  # notice before the scheduler announced the hold
    clock.now += 1
    table.hold("fast", 5, fast)
    assert table.pop_finished() == ({"fast"}, set())
    clock.now += 3.5
    assert table.pop_finished() == (set(), set())
    clock.now += 0.5
    assert table.pop_finished() == (set(), {"orphan"})
    assert table.release("orphan", "d", 1, TOKEN) == "expired"  # too late: the blocks may be reused
    assert table.renew([("orphan", TOKEN)]) == [(0.0, "expired")]
    assert table.release("fresh", "d", 1, issued("fresh")) == "unknown"  # kept until its hold arrives
    assert table.release("forged", "d", 1, TOKEN) == "unauthorized"  # a token this engine never issued
    assert list(table._unknown) == ["fresh"]


def test_renewals_shorten_the_initial_lease_and_keep_a_slow_decode_s_blocks():
    clock = Clock()
    table = HoldTable(timeout_s=30, lease_s=4, clock=clock)
    for rid in ("dead", "slow", "unclaimed"):
        table.hold(rid, 30, TOKEN)
    assert _renew(table, "dead", "slow") == [4, 4]
    for _ in range(30):  # the slow decode renews every 2 s for a minute, twice the initial lease
        clock.now += 2
        assert _renew(table, "slow") == [4]
        released, lapsed = table.pop_finished()
        assert "slow" not in lapsed
        if clock.now - 100 < 4:
            assert lapsed == set()
        elif clock.now - 100 < 6:
            assert lapsed == {"dead"}  # 4 s after its last renewal, not after the 30 s initial lease
        if 30 <= clock.now - 100 < 32:
            assert lapsed == {"unclaimed"}  # never claimed: the initial lease applies
    assert table.release("slow", "d", 1, TOKEN) == "ok"
    assert table.pop_finished() == ({"slow"}, set())
    assert _renew(table, "slow") == [0.0]  # released: nothing to keep any more


def _renew(table, *request_ids, token=TOKEN):
    return [seconds for seconds, _ in table.renew((rid, token) for rid in request_ids)]


def test_early_renewal_is_honoured_when_the_hold_is_announced():
    clock = Clock()
    table = HoldTable(timeout_s=5, lease_s=5, clock=clock, key=KEY)
    token = issued("early")
    assert _renew(table, "early", token=token) == [5]
    clock.now += 1
    assert table.hold("early", 2, token) == 0  # shorter than the lease already granted: the grant wins
    clock.now += 4.9
    assert table.pop_finished() == (set(), set())
    clock.now += 0.2
    assert table.pop_finished() == (set(), {"early"})


def test_early_renewal_with_a_wrong_token_is_dropped_when_the_hold_arrives():
    clock = Clock()
    table = HoldTable(timeout_s=5, lease_s=5, clock=clock, key=KEY)
    assert _renew(table, "r", token=OTHER) == [0.0]  # never issued: refused at once, nothing kept
    replayed, token = issued("r"), issued("r")  # an earlier hold of the same id had the first
    assert _renew(table, "r", token=replayed) == [5]  # issued, so kept until the hold's own token arrives
    clock.now += 1
    assert table.hold("r", 2, token) == 1  # counted as refused; the replayed grant does not extend the hold
    clock.now += 2
    assert table.pop_finished() == (set(), {"r"})


def test_table_of_unknown_notices_is_bounded_and_forgotten():
    clock = Clock()
    table = HoldTable(timeout_s=5, clock=clock, max_unknown=100, key=KEY)
    for i in range(10_000):
        table.release(f"stray-{i}", "d", 1, issued(f"stray-{i}"))
        _renew(table, f"claim-{i}", token=issued(f"claim-{i}"))
        table.release(f"forged-{i}", "d", 1, TOKEN)  # a stranger's: never kept, never evicts
    assert len(table._unknown) == 100 and "claim-9999" in table._unknown  # newest kept
    assert not any(rid.startswith("forged") for rid in table._unknown)
    clock.now += 6
    table.pop_finished()
    assert not table._unknown and len(table) == 0
    table.hold("stray-9999", 5, TOKEN)  # a late hold is not released by the forgotten notice
    assert table.pop_finished() == (set(), set()) and len(table) == 1


def test_done_notice_needs_the_live_token():
    table = HoldTable(timeout_s=30, key=KEY)
    table.hold("r", 30, TOKEN)
    assert table.authorize("r", OTHER) == "unauthorized"
    assert table.release("r", "attacker", 1, OTHER) == "unauthorized"
    assert table.pop_finished() == (set(), set()) and len(table) == 1  # still held
    assert table.authorize("r", TOKEN) == "ok" and table.authorize("nope", issued("nope")) == "unknown"
    assert table.authorize("nope", TOKEN) == table.authorize("nope", issued("other")) == "unauthorized"
    assert table.release("r", "decode/pp0/tp0", 1, TOKEN) == "ok"
    assert table.pop_finished() == ({"r"}, set())


def test_early_notice_with_wrong_token_is_dropped_when_the_hold_arrives():
    table = HoldTable(timeout_s=30, key=KEY)
    token = issued("r")
    assert table.release("r", "attacker", 1, OTHER) == "unauthorized"  # never kept
    assert table.release("r", "replayer", 1, issued("r")) == "unknown"  # issued for an earlier hold of r
    assert table.release("r", "decode/pp0/tp0", 2, token) == "unknown"
    assert table.hold("r", 30, token) == 1  # the replayed notice, counted by the caller
    assert table.pop_finished() == (set(), set())  # one genuine consumer of two so far
    table.release("r", "decode/pp0/tp1", 2, token)
    assert table.pop_finished() == ({"r"}, set())


def test_tokens_are_believed_only_from_this_engine_and_tell_their_age():
    import time

    from connectors.mooncake import tokens

    before = time.time()
    token = tokens.issue(KEY, "r")
    now = time.time()
    assert len(token) == 54 and 0 <= tokens.issued_age(KEY, "r", token, now=now) <= now - before + 1e-3  # ms stamps
    assert tokens.issued_age(b"x" * 32, "r", token) is None  # another engine's key
    assert tokens.issued_age(KEY, "r2", token) is None  # another request's token
    assert tokens.issued_age(KEY, "r", token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert tokens.issued_age(KEY, "r", tokens.issue(KEY, "r", now=now - 31), now=now) == pytest.approx(31, abs=1e-3)
    assert tokens.issued_age(KEY, "r", tokens.issue(KEY, "r", now=time.time() + 60)) is None  # from the future
    assert all(tokens.issued_age(KEY, "r", t) is None for t in ("", "A" * 43, "#" * 54, token + "AA"))
    assert HoldTable(timeout_s=30).authorize("r", token) == "unauthorized"  # no key yet: nothing issued


def test_a_genuine_token_older_than_the_timeout_is_told_its_hold_is_over():
    """The decode that comes back after the hold lapsed and was forgotten (a pull stalled past both) hears
    "expired", which stops its renewals, and is never taken for a stranger; a forged token still is one."""
    import time

    from connectors.mooncake import tokens

    table = HoldTable(timeout_s=30, key=KEY)
    old = tokens.issue(KEY, "r", now=time.time() - 31)
    assert table.authorize("r", old) == "expired"
    assert table.release("r", "d", 1, old) == "expired"
    assert table.renew([("r", old)]) == [(0.0, "expired")]
    assert table.authorize("r", OTHER) == "unauthorized"
    assert not table._unknown and len(table) == 0  # nothing kept for it


def test_ended_hold_is_not_revived_by_a_late_or_replayed_notice():
    table = HoldTable(timeout_s=30)
    table.hold("r", 30, TOKEN)
    assert table.release("r", "d0", 1, TOKEN) == "ok"
    assert table.pop_finished() == ({"r"}, set())
    assert table.release("r", "d0", 1, TOKEN) == "ok"  # a repeated notice: the read was held
    assert table.release("r", "d1", 1, TOKEN) == "expired"  # anyone else: the blocks are gone
    assert table.release("r", "d0", 1, OTHER) == "unauthorized"
    assert table.renew([("r", TOKEN)]) == [(0.0, "expired")]
    assert table.authorize("r", TOKEN) == "expired"
    assert not table._unknown and len(table) == 0 and table.pop_finished() == (set(), set())
