"""What a prefill worker answers on its side channel, and to whom.

Metadata (layer addresses, transfer-engine port), lease renewals and releases of held blocks go
only to a peer that presents the token the prefill issued for a request it holds now. A metadata
request naming a hold not announced to this worker yet is answered once the announcement arrives
(the server defers it briefly); a done-notice or renewal that early is kept and checked against the
token when the hold arrives.
"""

from __future__ import annotations

from collections.abc import Callable

from connectors.mooncake.channel import Refused
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.messages import (
    PROTOCOL_VERSION,
    DoneNotice,
    LeaseGrant,
    LeaseRenewal,
    Message,
    MetaRequest,
    Released,
    WorkerMeta,
)


class PrefillResponder:
    def __init__(self, holds: HoldTable, on_renewed: Callable[[int], None] = lambda granted: None) -> None:
        self.holds = holds
        self.on_renewed = on_renewed
        """Told how many claims of each renewal were granted (the worker's lease counter)."""
        self.meta: WorkerMeta | None = None
        """Set once the KV caches are registered."""

    def __call__(self, message: Message) -> Message | None:
        if isinstance(message, MetaRequest):
            verdict = self.holds.authorize(message.request_id, message.token)
            if verdict == "unknown":
                return None
            if verdict != "ok":
                raise Refused(verdict, f"metadata request for {message.request_id!r}: hold {verdict}")
            if self.meta is None:
                raise Refused("not_ready", "metadata requested before the KV caches were registered")
            return self.meta
        if isinstance(message, DoneNotice):
            verdict = self.holds.release(message.request_id, message.consumer, message.num_consumers, message.token)
            if verdict == "unauthorized":
                raise Refused(verdict, f"done-notice for {message.request_id!r} from {message.consumer!r} "
                              "with a wrong token; its blocks stay held")
            return Released(version=PROTOCOL_VERSION, request_id=message.request_id, held=verdict != "expired")
        if isinstance(message, LeaseRenewal):
            granted = self.holds.renew((claim.request_id, claim.token) for claim in message.claims)
            self.on_renewed(sum(verdict == "ok" for _, verdict in granted))
            grant = LeaseGrant(version=PROTOCOL_VERSION, seconds=[seconds for seconds, _ in granted])
            forged = [claim.request_id for claim, (_, verdict) in zip(message.claims, granted)
                      if verdict == "unauthorized"]
            if forged:
                # The rightful claims of a batch keep their grant (a decode may carry one forged handle);
                # the forged ones get 0 and the renewal counts as refused.
                raise Refused("unauthorized", f"lease renewal with a wrong token for {forged[:8]!r}"
                              + (f" and {len(forged) - 8} more" if len(forged) > 8 else ""),
                              reply=None if len(forged) == len(granted) else grant)
            return grant
        raise Refused("malformed", f"{type(message).__name__} is not a request")
