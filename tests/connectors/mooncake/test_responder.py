"""The prefill's responder: its verdict on each side-channel message."""

from __future__ import annotations

import time

import pytest

from connectors.mooncake import messages as m
from connectors.mooncake import tokens
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.responder import PrefillResponder
from tests.helpers.clock import Clock
from tests.helpers.mooncake_wire import KEY, OTHER, TOKEN, V, issued, worker_meta

pytestmark = pytest.mark.unit


def test_hold_table_answers_notices_and_renewals():
    from connectors.mooncake.channel import Refused

    table = HoldTable(timeout_s=30, lease_s=3, clock=Clock(), key=KEY)
    table.hold("r", 30, TOKEN)
    responder = PrefillResponder(table)
    renewal = m.LeaseRenewal(version=V, claims=[m.LeaseClaim(request_id="r", token=TOKEN),
                                                m.LeaseClaim(request_id="x", token=issued("x"))])
    assert responder(m.decode(m.encode(renewal))) == m.LeaseGrant(version=V, seconds=[3, 3])
    notice = m.DoneNotice(version=V, request_id="r", token=TOKEN, consumer="d", num_consumers=1, success=True)
    assert responder(notice) == m.Released(version=V, request_id="r", held=True)
    with pytest.raises(Refused) as info:
        responder(m.MetaRequest(version=V, request_id="r", token=TOKEN))
    assert info.value.code == "not_ready"


def test_responder_verdicts():
    from connectors.mooncake.channel import Refused

    table = HoldTable(timeout_s=30, key=KEY)
    responder = PrefillResponder(table)
    token = issued("r")
    ask = m.MetaRequest(version=V, request_id="r", token=token)
    assert responder(ask) is None  # hold not announced yet, the token one this engine issued: the server defers
    with pytest.raises(Refused) as info:  # not one it issued: refused at once, never deferred
        responder(m.MetaRequest(version=V, request_id="r", token=TOKEN))
    assert info.value.code == "unauthorized"
    table.hold("r", 30, token)
    with pytest.raises(Refused) as info:
        responder(ask)
    assert info.value.code == "not_ready"
    responder.meta = worker_meta()
    assert responder(ask) == responder.meta
    with pytest.raises(Refused) as info:
        responder(m.MetaRequest(version=V, request_id="r", token=OTHER))
    assert info.value.code == "unauthorized"
    with pytest.raises(Refused) as info:
        responder(m.DoneNotice(version=V, request_id="r", token=OTHER, consumer="c", num_consumers=1, success=True))
    assert info.value.code == "unauthorized"
    with pytest.raises(Refused) as info:
        responder(m.Ack(version=V, ok=True))
    assert info.value.code == "malformed"
    late = tokens.issue(KEY, "gone", now=time.time() - 31)  # its hold lapsed and was forgotten
    with pytest.raises(Refused) as info:
        responder(m.MetaRequest(version=V, request_id="gone", token=late))
    assert info.value.code == "expired" and "hold expired" in str(info.value)
    assert responder(m.DoneNotice(version=V, request_id="gone", token=late, consumer="c", num_consumers=1,
                                  success=False)) == m.Released(version=V, request_id="gone", held=False)


def test_lease_renewal_needs_the_live_token():
    from connectors.mooncake.channel import Refused

    clock = [100.0]
    table = HoldTable(timeout_s=30, lease_s=3, clock=lambda: clock[0])
    granted = []
    responder = PrefillResponder(table, on_renewed=granted.append)
    table.hold("r", 5, TOKEN)
    table.hold("s", 5, TOKEN)

    def renewal(*claims):
        return m.LeaseRenewal(version=V, claims=[m.LeaseClaim(request_id=r, token=t) for r, t in claims])

    with pytest.raises(Refused) as info:  # only forged claims: refused like a forged notice
        responder(renewal(("r", OTHER)))
    assert info.value.code == "unauthorized" and info.value.reply is None
    clock[0] += 4
    with pytest.raises(Refused) as info:  # a batch with one forged claim: counted, the rest granted
        responder(renewal(("r", OTHER), ("s", TOKEN)))
    assert info.value.code == "unauthorized" and info.value.reply == m.LeaseGrant(version=V, seconds=[0.0, 3.0])
    clock[0] += 1
    assert table.pop_finished() == (set(), {"r"})  # the forged renewals did not keep r's blocks
    assert responder(renewal(("s", TOKEN))) == m.LeaseGrant(version=V, seconds=[3.0])
    assert granted == [0, 1, 1]  # per renewal: the claims that kept a live hold (forged ones never count)
