"""The decode's puller: how long a read is trusted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connectors.mooncake import messages as m
from tests.helpers.mooncake_wire import V

pytestmark = pytest.mark.unit


def test_read_is_trusted_only_within_the_granted_lease():
    from connectors.mooncake.channel import ChannelError
    from connectors.mooncake.puller import Puller

    waited_until = []

    def claim(*grants):
        answers = [g if isinstance(g, ChannelError) else m.LeaseGrant(version=V, seconds=[g]) for g in grants]
        return SimpleNamespace(sent_at=50.0, results=lambda until=None: waited_until.append(until) or answers)

    assert Puller.lease_end(claim(5.0, 3.0)) == 53.0  # the shortest grant of all prefill workers
    assert Puller.lease_end(claim(5.0, 0.0)) is None  # one worker had freed the blocks
    assert Puller.lease_end(claim(5.0, ChannelError("no answer")), until=51.5) is None
    assert waited_until == [None, None, 51.5]  # a stalled prefill's grant is waited for until then only


def test_after_a_given_up_pull_the_next_reads_nothing_until_the_prefill_answers_its_renewal():
    from connectors.mooncake.channel import NoAnswer
    from connectors.mooncake.puller import Puller
    from connectors.mooncake.stall import LinkRate, PrefillProgress, StallWatch
    from connectors.mooncake.transfer import Stalled
    from tests.helpers.mooncake_wire import handle_params, worker_meta

    puller = Puller(transfer=None, local=worker_meta(), timeout_s=1.0, consumer_id="d", num_consumers=1)
    handle = m.parse_handle(handle_params())
    progress = PrefillProgress()
    progress.saw(100.0)
    progress.gave_up()  # a pull from this prefill found it stalled after its last read landed
    asked = []

    class Claim:
        def results(self, until=None):
            asked.append(until)
            return [NoAnswer("no answer")]

    watch = StallWatch(2.0, LinkRate(), progress, since=1e12)  # far from expired
    with pytest.raises(Stalled, match="has not answered since a pull from it was given up") as stalled:
        puller.read(handle, [0], [3], watch, Claim())  # neither metadata nor a read is asked for
    assert stalled.value.drain is None and asked == [watch.deadline()]
    expired = StallWatch(2.0, LinkRate(), progress, since=0.0)
    with pytest.raises(Stalled, match="made no progress for 2 s before this pull's turn"):
        puller.read(handle, [0], [3], expired, Claim())
    progress.saw(200.0)  # a read from it landed: no longer suspect
    assert not progress.stalled


def test_a_prefill_found_stalled_that_answers_the_next_pull_s_renewal_is_read_from_again():
    from connectors.mooncake.puller import Puller
    from connectors.mooncake.stall import LinkRate, PrefillProgress, StallWatch
    from tests.helpers.mooncake_wire import handle_params, worker_meta

    class Reached(Exception):
        pass

    class Claim:
        def results(self, until=None):
            return [m.LeaseGrant(version=V, seconds=[5.0])]

    puller = Puller(transfer=None, local=worker_meta(), timeout_s=1.0, consumer_id="d", num_consumers=1)
    puller.peer_metas = lambda handle, watch=None: (_ for _ in ()).throw(Reached())  # the pull went on to ask for metadata
    progress = PrefillProgress()
    progress.gave_up()
    with pytest.raises(Reached):
        puller.read(m.parse_handle(handle_params()), [0], [3], StallWatch(2.0, LinkRate(), progress, since=1e12),
                    Claim())
    assert not progress.stalled and progress.last > 0  # the answer counts as progress


def test_a_metadata_fetch_from_a_silent_prefill_ends_at_the_pull_s_stall_deadline_not_the_handshake_timeout():
    """A pull queued behind one that failed (its prefill's metadata forgotten) asks for metadata when its turn
    comes: a prefill that stopped answering costs it what is left of its stall bound, not the handshake timeout
    (5 s) on top of the bound its predecessor waited; a deadline already past asks nothing."""
    import time

    from connectors.mooncake.channel import NoAnswer
    from connectors.mooncake.puller import Puller
    from connectors.mooncake.stall import LinkRate, PrefillProgress, StallWatch
    from connectors.mooncake.transfer import Stalled
    from tests.helpers.mooncake_wire import handle_params, worker_meta

    puller = Puller(transfer=None, local=worker_meta(), timeout_s=5.0, consumer_id="d", num_consumers=1)
    handle = m.parse_handle(handle_params())
    asked = []

    def silent(handle, message, expected, check_first=None, timeout_s=None):
        asked.append(timeout_s)
        time.sleep(timeout_s)  # as a call nobody answers: it runs out its timeout
        return [NoAnswer("no answer")]

    puller._ask = silent
    watch = StallWatch(2.0, LinkRate(), PrefillProgress(), since=time.monotonic() - 1.8)
    with pytest.raises(Stalled, match="did not answer this pull's metadata request within its stall bound"):
        puller.peer_metas(handle, watch)
    assert asked and 0 < asked[0] <= 0.2
    past = StallWatch(2.0, LinkRate(), PrefillProgress(), since=time.monotonic() - 3.0)
    with pytest.raises(Stalled, match="before this pull asked its metadata"):
        puller.peer_metas(handle, past)
    assert len(asked) == 1
    with pytest.raises(NoAnswer):  # without a watch (the benches): the handshake timeout, a plain channel error
        puller._ask = lambda *args, timeout_s=None, **kwargs: asked.append(timeout_s) or [NoAnswer("no answer")]
        puller.peer_metas(handle)
    assert asked[-1] == 5.0
