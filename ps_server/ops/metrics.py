"""Prometheus metrics of one shard, served on their own port.

A registry of our own (not the process-global default), so tests can run
several servers in one process. Label cardinality is bounded: variables by
--max-variables, outcomes by the fixed set of error reasons.
"""

from __future__ import annotations

import bisect
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = ["Metrics"]

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_VERSIONS = (0, 1, 2, 3, 5, 10, 20, 50, 100, 1000)


class Metrics:
    """One shard's metrics, and the HTTP server that exports them (its thread started and stopped here)."""

    def __init__(self) -> None:
        self._http: _MetricsServer | None = None
        self._http_thread: threading.Thread | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.pushes = VariableOutcomeCounter("wehub_ps_pushes", "Pushes per variable and outcome (ok, "
                                             "duplicate, dropped, or the error reason)", r)
        self.pulls = VariableOutcomeCounter("wehub_ps_pulls", "Pulls per variable and outcome", r)
        self.bytes_received = Counter("wehub_ps_bytes_received", "Tensor bytes received (pushes)", registry=r)
        self.bytes_sent = Counter("wehub_ps_bytes_sent", "Tensor bytes sent (pulls)", registry=r)
        self.apply_seconds = Histogram("wehub_ps_apply_seconds", "Time to apply the chunks of one push "
                                       "message (at most --chunk-bytes of gradients)",
                                       buckets=_SECONDS, registry=r)
        self.staleness = CountHistogram("wehub_ps_push_staleness", "Server version minus the version a pushed "
                                        "gradient was computed from", _VERSIONS, r)
        self.live_workers = Gauge("wehub_ps_live_workers", "Workers holding a lease", registry=r)
        self.checkpoint_seconds = Histogram("wehub_ps_checkpoint_seconds", "Checkpoint write time",
                                            buckets=_SECONDS, registry=r)
        self._last_checkpoint = time.time()
        self.checkpoint_age = Gauge("wehub_ps_checkpoint_age_seconds", "Seconds since the last checkpoint "
                                    "(since start when none was written)", registry=r)
        self.checkpoint_age.set_function(lambda: time.time() - self._last_checkpoint)
        self.restored_version = Gauge("wehub_ps_restored_version", "Version of each variable restored from "
                                      "the checkpoint at start", ["variable"], registry=r)

    def watch_tables(self, describe: Callable[[], Sequence]) -> None:
        """Export the hash tables' rows and policy counts, read from ``describe()`` (the store's
        VariableInfo list) at each scrape."""
        self.registry.register(HashTableCollector(describe))

    def checkpoint_written(self, seconds: float) -> None:
        self.checkpoint_seconds.observe(seconds)
        self._last_checkpoint = time.time()

    def push_applied(self, seconds: float) -> None:
        """One push message's chunks were applied in ``seconds`` (ps_server.core.pushes.PushObserver)."""
        self.apply_seconds.observe(seconds)

    def push_staleness(self, staleness: list[int]) -> None:
        """A push began this many versions behind its variables (ps_server.core.pushes.PushObserver)."""
        self.staleness.observe_many(staleness)

    def serve(self, port: int, host: str, certfile: str | None, keyfile: str | None,
              client_ca: str | None = None, token_matches: Callable[[bytes], bool] | None = None) -> int:
        """Serve /metrics on a thread named ``ps-metrics`` until :meth:`stop`; returns the bound port.

        The metrics port guards what the gRPC port guards: over TLS when a
        certificate is given; with ``client_ca`` (--tls-client-ca) only a
        client presenting a certificate issued by it completes the
        handshake; with ``token_matches`` (--auth-token-file) a request
        without ``Authorization: Bearer <token>`` gets 401 (Prometheus sends
        one from ``authorization.credentials_file``).
        """
        if self._http is not None:
            raise RuntimeError("the metrics are served already")
        app = make_wsgi_app(self.registry)
        if token_matches is not None:
            app = _bearer_protected(app, token_matches)
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
        httpd = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
        if certfile and keyfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            if client_ca:
                context.load_verify_locations(cafile=client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
            # The handshake runs on the request's own thread (first read), so a
            # client that stalls in it holds that thread only, not the accept loop.
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        # A daemon: a process that exits without stop() is not held open by it.
        thread = threading.Thread(target=httpd.serve_forever, name="ps-metrics", daemon=True)
        thread.start()
        self._http, self._http_thread = httpd, thread
        return httpd.server_port

    def stop(self) -> None:
        """Stop serving /metrics: the port is closed and the thread has ended when this returns."""
        httpd, thread = self._http, self._http_thread
        if httpd is None or thread is None:
            return
        self._http = self._http_thread = None
        httpd.shutdown()  # returns once serve_forever has left its loop
        httpd.server_close()
        thread.join()


class HashTableCollector:
    """Per hash table on this shard: rows held, and the rows eviction, expiry and admission counted.

    Read from the store when scraped, so nothing is counted twice; the
    labels are the tables' names (bounded by --max-variables).
    """

    #: (metric name, VariableInfo field, help) of each counter.
    COUNTERS = (
        ("wehub_ps_table_evicted_rows", "evicted_rows", "Rows evicted at max_rows (LRU)"),
        ("wehub_ps_table_expired_rows", "expired_rows", "Rows removed by expiry"),
        ("wehub_ps_table_admitted_rows", "admitted_rows", "Ids admitted as rows"),
        ("wehub_ps_table_unadmitted_reads", "unadmitted_reads",
         "Pull answers for ids not admitted yet (no row made)"),
        ("wehub_ps_table_dropped_gradient_rows", "dropped_gradient_rows",
         "Gradient rows dropped because their id had no row"),
        ("wehub_ps_table_memory_hits", "memory_hits", "Rows of a table with a disk tier found in memory when touched"),
        ("wehub_ps_table_cold_reads", "cold_reads", "Rows read back from a table's disk tier"),
    )
    #: (metric name, VariableInfo field, help) of each gauge beside the rows.
    GAUGES = (
        ("wehub_ps_table_rows_on_disk", "rows_on_disk", "Rows of each hash table in its disk tier on this shard"),
        ("wehub_ps_table_disk_bytes", "disk_bytes", "Bytes of each hash table's row file on this shard"),
    )

    def __init__(self, describe: Callable[[], Sequence]) -> None:
        self._describe = describe

    def describe(self) -> list:
        return []  # the families depend on the tables: not checked at registration

    def collect(self) -> Iterator:
        tables = [info for info in self._describe() if info.spec.hash_table]
        rows = GaugeMetricFamily("wehub_ps_table_rows", "Rows of each hash table held on this shard",
                                 labels=["variable"])
        for info in tables:
            rows.add_metric([info.spec.name], info.num_rows)
        yield rows
        for name, attr, documentation in self.GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["variable"])
            for info in tables:
                gauge.add_metric([info.spec.name], getattr(info, attr))
            yield gauge
        for name, attr, documentation in self.COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["variable"])
            for info in tables:
                family.add_metric([info.spec.name], getattr(info, attr))
            yield family


class VariableOutcomeCounter:
    """A counter labelled (variable, outcome), counted in a dict and exported when scraped.

    A step of a model with many small variables counts one pull and one push
    per variable; a prometheus_client Counter takes a lock per label lookup
    and per increment, which cost the server more than applying the
    gradients (measured with yappi). Here a request counts all its variables
    under one lock.
    """

    LABELS = ("variable", "outcome")

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        # Guards _counts.
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        registry.register(self)

    def add(self, variables: Iterable[str], outcome: str) -> None:
        """One more ``outcome`` for each of ``variables``."""
        with self._lock:
            counts = self._counts
            for variable in variables:
                key = (variable, outcome)
                counts[key] = counts.get(key, 0) + 1

    def value(self, variable: str, outcome: str) -> int:
        with self._lock:
            return self._counts.get((variable, outcome), 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=list(self.LABELS))
        with self._lock:
            counts = sorted(self._counts.items())
        for (variable, outcome), count in counts:
            family.add_metric([variable, outcome], count)
        yield family


class CountHistogram:
    """A histogram of whole numbers that a request observes all at once, exported when scraped.

    A push observes the staleness of each of its variables; prometheus_client's
    Histogram takes two locks and walks its buckets in Python per observation,
    about 2 us each, which for a model of a hundred small variables cost a
    server 0.2 ms per push (measured with yappi). Here one lock per push.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[int], registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = list(buckets)
        # Guards _counts and _sum. _counts[i]: observations in (bound i-1, bound i]; the last is +Inf.
        self._lock = threading.Lock()
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0
        registry.register(self)

    def observe_many(self, values: Iterable[int]) -> None:
        """One observation of each of ``values``."""
        bounds, counts = self._bounds, self._counts
        with self._lock:
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1
                self._sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*map(floatToGoString, self._bounds), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=total)


def _bearer_protected(app: Callable, token_matches: Callable[[bytes], bool]) -> Callable:
    """``app`` behind a bearer token check (401 without the right one)."""

    def protected(environ: dict, start_response: Callable) -> Iterable[bytes]:
        raw = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1")
        presented = raw[7:].strip() if raw[:7].lower() == b"bearer " else b""
        if not presented or not token_matches(presented):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="wehub-ps metrics"')])
            return [b"this ps-server's metrics need the bearer token of --auth-token-file\n"]
        return app(environ, start_response)

    return protected


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection (named), for /metrics."""

    daemon_threads = True

    def process_request(self, request, client_address) -> None:
        threading.Thread(target=self.process_request_thread, args=(request, client_address),
                         name="ps-metrics-request", daemon=True).start()

    def handle_error(self, request, client_address) -> None:
        pass  # a client that fails the TLS handshake or hangs up: nothing to do, nothing to log


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr; a bound on how long one connection may stall."""

    timeout = 30

    def log_message(self, format: str, *args: object) -> None:
        pass
