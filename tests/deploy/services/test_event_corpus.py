"""Property (Hypothesis): no message a publisher can send stops a KV event stream. Over 10^5 random and adversarial
messages in vLLM's wire format (tests/helpers/kv_event_corpus.py: well-formed and not, frames, payloads, events and
sequence numbers), decoded and applied to an index as the proxy does (`EventStream.handle`), nothing raises, the
index stays within its bound and consistent (cleared, it marks no key), and a good batch after them is applied;
whether or not the proxy was told the prefills' block size (`--kv-events-block-size`)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from deploy.services.event_stream import EventMetrics, EventStream
from deploy.services.kv_events import REFUSED_KINDS
from deploy.services.prefix_index import PrefixIndex, iter_keys
from tests.helpers.event_streams import batch, stored
from tests.helpers.kv_event_corpus import BS, Corpus, corpora, encode

EXAMPLES = 250
MESSAGES = 400
"""Messages per example: EXAMPLES * MESSAGES >= 10^5."""
MAX_BLOCKS = 32
"""Small, so that the bound is reached and trimmed past all the time."""
GOOD = list(range(1000, 1000 + 3 * BS))


def follow(corpus: Corpus, told: bool) -> tuple[EventStream, CollectorRegistry, int]:
    """A stream (no replay endpoint) fed the corpus's messages, its index told the block size or learning it from
    the first event; returns it, its registry and the last sequence number sent."""
    registry = CollectorRegistry()
    index = PrefixIndex(MAX_BLOCKS, block_size=BS if told else None)
    stream = EventStream("p0", "tcp://127.0.0.1:1", index, EventMetrics(registry), 1.0)
    last = 0
    for frames in corpus.messages(MESSAGES):
        stream.handle(frames)
        if len(frames) == 3 and len(frames[1]) == 8:
            last = max(last, int.from_bytes(frames[1], "big", signed=True))
    return stream, registry, last


@pytest.mark.unit
def test_no_message_stops_the_stream_and_a_good_batch_after_them_is_applied():
    fed, refused = [], {kind: 0.0 for kind in REFUSED_KINDS}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(corpora, st.booleans())
    def check(corpus, told):
        stream, registry, last = follow(corpus, told)
        index = stream.index
        assert len(index) <= MAX_BLOCKS and index.orphans <= MAX_BLOCKS
        applied = registry.get_sample_value("kvpp_proxy_kv_event_batches_total", {"backend": "p0"}) or 0
        good = [b"", (last + 1).to_bytes(8, "big"), encode(batch(stored([b"g1", b"g2", b"g3"], None, GOOD)))]
        stream.handle(good)
        assert index.matched_blocks(iter_keys(GOOD, BS)) == 3
        assert registry.get_sample_value("kvpp_proxy_kv_event_batches_total", {"backend": "p0"}) == applied + 1
        stream.handle([b"", (last + 2).to_bytes(8, "big"), encode(batch())])  # an empty batch: nothing changes
        assert index.matched_blocks(iter_keys(GOOD, BS)) == 3
        index.clear()
        assert not index.holders.by_key and len(index) == 0 and index.orphans == 0
        fed.append(MESSAGES + 2)
        for kind in REFUSED_KINDS:
            refused[kind] += registry.get_sample_value("kvpp_proxy_kv_event_refused_total",
                                                       {"backend": "p0", "kind": kind})

    check()
    assert sum(fed) >= 100_000
    assert all(refused.values()), refused  # every kind of refusal was met
