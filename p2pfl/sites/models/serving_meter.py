"""What the serving processes answered, for the site daemon's ``/metrics``
(docs/design.md, "A site's own models"): ``p2pfl_serving_requests_total{route, code}`` and
``p2pfl_serving_request_seconds{route}`` (from a request's head read to its answer
written).

The serving process and its workers are not the daemon: they count in
``prometheus_client``'s multiprocess mode, each process into its own files in
``PROMETHEUS_MULTIPROC_DIR``, which the daemon sets when it starts ``p2pfl serve``
(:data:`~p2pfl.sites.runs.processes.METRICS_ENV`; ``prometheus_client`` reads it when it is
imported) and reads back with a ``MultiProcessCollector`` (:class:`~p2pfl.sites.daemon.
observe.SiteMetrics`). Without it (``p2pfl serve`` run by hand, a test's server) the counts
stay in the process. Labels are bounded: ``route`` is one of :data:`ROUTES`, ``code`` one
of the statuses the server sends."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

ROUTES = (
    "v1_predict",
    "v1_model",
    "infer",
    "metadata",
    "live",
    "ready",
    "model_ready",
    "unknown_model",
    "none",
)
"""What a request asked (:func:`~p2pfl.sites.models.serving_http.route`; ``none``: no route)."""

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
"""Upper bounds (s) of the latency histogram: one record takes about a millisecond here,
a large batch or a loaded machine seconds."""

REQUESTS = Counter(
    "p2pfl_serving_requests_total", "requests the site's served model answered", ["route", "code"]
)
LATENCY = Histogram(
    "p2pfl_serving_request_seconds",
    "from a request read to its answer written",
    ["route"],
    buckets=LATENCY_BUCKETS,
)


def answered(route: str, code: int, seconds: float) -> None:
    """One request to ``route`` answered with status ``code`` in ``seconds``."""
    route = route if route in ROUTES else "none"
    REQUESTS.labels(route, str(code)).inc()
    LATENCY.labels(route).observe(seconds)
