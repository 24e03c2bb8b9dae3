"""The served benches' latency figures from a stream's chunk arrivals."""

import pytest

from bench.serving import latencies

pytestmark = pytest.mark.unit


def test_latencies_from_chunk_arrivals():
    answers = [{"sent": 0.0, "arrivals": [0.5, 0.7, 0.9]}, {"sent": 1.0, "arrivals": [2.0, 2.5]}]
    figures = latencies(answers)
    assert figures["ttft_p50_s"] == pytest.approx(0.5) and figures["ttft_p99_s"] == pytest.approx(1.0)
    assert figures["tpot_p50_s"] == pytest.approx(0.2) and figures["tpot_p99_s"] == pytest.approx(0.5)
