"""The (variable, outcome) counters: exact under concurrency, exported like a Counter."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from ps_server.metrics import Metrics, VariableOutcomeCounter


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
