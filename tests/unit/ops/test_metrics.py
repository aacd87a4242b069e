"""The (variable, outcome) counters: exact under concurrency, exported like a Counter."""

from __future__ import annotations

import socket
import threading
import urllib.request

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ps_server.ops.metrics import CountHistogram, Metrics, VariableOutcomeCounter


def test_counts_from_many_threads_are_exact():
    counter = VariableOutcomeCounter("t_pushes", "test", CollectorRegistry())
    names = [f"v{i}" for i in range(10)]

    def count() -> None:
        for _ in range(500):
            counter.add(names, "ok")
        counter.add(names[:3], "INVALID_CHUNK")

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(counter.value(name, "ok") == 8 * 500 for name in names)
    assert counter.value("v0", "INVALID_CHUNK") == 8
    assert counter.value("v9", "INVALID_CHUNK") == 0


def test_exported_as_a_counter_with_variable_and_outcome_labels():
    metrics = Metrics()
    metrics.pushes.add(["dense/kernel", "dense/bias"], "ok")
    metrics.pushes.add(["dense/kernel"], "ok")
    metrics.pulls.add(["-"], "UNKNOWN_VARIABLE")
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE wehub_ps_pushes_total counter" in text
    assert 'wehub_ps_pushes_total{outcome="ok",variable="dense/kernel"} 2.0' in text
    assert 'wehub_ps_pushes_total{outcome="ok",variable="dense/bias"} 1.0' in text
    assert 'wehub_ps_pulls_total{outcome="UNKNOWN_VARIABLE",variable="-"} 1.0' in text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5000), max_size=20), max_size=10))
def test_count_histogram_exports_what_a_prometheus_histogram_would(batches):
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    bounds = (0, 1, 2, 3, 5, 10, 20, 50, 100, 1000)
    ours = CountHistogram("t_staleness", "test", bounds, ours_registry)
    theirs = Histogram("t_staleness", "test", buckets=bounds, registry=theirs_registry)
    for batch in batches:
        ours.observe_many(batch)
        for value in batch:
            theirs.observe(value)

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}

    assert samples(ours_registry) == samples(theirs_registry)


def test_count_histogram_is_exact_under_concurrency():
    registry = CollectorRegistry()
    histogram = CountHistogram("t_staleness", "test", (0, 1, 5), registry)

    def observe() -> None:
        for _ in range(300):
            histogram.observe_many([0, 1, 2, 7])

    threads = [threading.Thread(target=observe) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    text = generate_latest(registry).decode()
    assert 't_staleness_bucket{le="0.0"} 1800.0' in text
    assert 't_staleness_bucket{le="5.0"} 5400.0' in text
    assert 't_staleness_bucket{le="+Inf"} 7200.0' in text
    assert "t_staleness_sum 18000.0" in text and "t_staleness_count 7200.0" in text


def test_stop_closes_the_port_and_ends_the_thread():
    metrics = Metrics()
    port = metrics.serve(0, "127.0.0.1", None, None)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"wehub_ps_live_workers" in response.read()
    served_by = [t for t in threading.enumerate() if t.name == "ps-metrics"]
    assert served_by
    metrics.stop()
    assert not any(t.is_alive() for t in served_by)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    metrics.stop()  # a second stop does nothing
