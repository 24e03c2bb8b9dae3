"""What a prefill worker answers on its side channel, and to whom.

Metadata (layer addresses, transfer-engine port) and releases of held blocks go only to a peer
that presents the token the prefill issued for a request it holds now. A request naming a hold
not announced to this worker yet is answered once the announcement arrives (the server defers it
briefly); a done-notice that early is kept and checked against the token when the hold arrives.
"""

from __future__ import annotations

from connectors.mooncake.channel import Refused
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.messages import PROTOCOL_VERSION, DoneNotice, Message, MetaRequest, Released, WorkerMeta


class PrefillResponder:
    def __init__(self, holds: HoldTable) -> None:
        self.holds = holds
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
        raise Refused("malformed", f"{type(message).__name__} is not a request")
