"""The HTTP endpoints of a service: ``/metrics`` for Prometheus, ``/healthz`` (liveness) and
``/readyz`` (readiness) for an orchestrator, on one port, on a daemon thread.

Readiness asks ``freshcore.health.HEALTH`` with the partitions this process owns (the
``freshrec_assigned_partitions`` gauge it already sets) and a Redis ping of at most once a
second (0.5 s timeout). Both answer 200 or 503 with a one-line reason as plain text.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import redis
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from freshcore import metrics as m
from freshcore.health import HEALTH
from freshcore.redisconn import connect
from freshcore.settings import metrics_host

log = logging.getLogger("freshcore.endpoints")


class _RedisCheck:
    def __init__(self, url: str | None) -> None:
        self.url = url
        self.client = None  # made at the first check: a cluster's client reads its slot map
        self._at = -1.0
        self._lock = threading.Lock()

    def refresh(self) -> None:
        if self.url is None:
            return
        with self._lock:
            if time.monotonic() - self._at < 1.0:
                return
            self._at = time.monotonic()
            try:
                if self.client is None:
                    self.client = connect(
                        self.url, wait_s=0, socket_timeout=0.5, socket_connect_timeout=0.5
                    )
                HEALTH.redis(bool(self.client.ping()))
            except redis.RedisError:
                HEALTH.redis(False)


def _assigned() -> int:
    return int(sum(s.value for metric in m.ASSIGNED_PARTITIONS.collect() for s in metric.samples))


def start_endpoints(host: str, port: int, registry=None, redis_url: str | None = None):
    """Start serving; returns the server (``shutdown()`` stops it)."""
    registry = REGISTRY if registry is None else registry
    check = _RedisCheck(redis_url)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            if path == "/metrics":
                names = parse_qs(query).get("name[]")  # as prometheus_client's own server
                source = registry.restricted_registry(names) if names else registry
                self._send(200, generate_latest(source), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, why = HEALTH.live()
                self._send(200 if ok else 503, why.encode() + b"\n")
            elif path == "/readyz":
                HEALTH.assigned(_assigned())
                check.refresh()
                ok, why = HEALTH.ready()
                self._send(200 if ok else 503, why.encode() + b"\n")
            else:
                self._send(404, b"not found: /metrics, /healthz, /readyz\n")

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes and probes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="endpoints").start()
    return server


def serve_metrics(
    port: int, registry=None, redis_url: str | None = None, host: str | None = None
) -> None:
    """Serve ``/metrics`` (this process's registry, or ``registry``:
    ``freshcore.childmetrics.MergedRegistry`` where a child process has metrics too),
    ``/healthz`` and ``/readyz`` (``freshcore.health``; readiness pings ``redis_url``) on
    ``host:port`` — ``FRESHREC_METRICS_HOST``, loopback unless configured. Port 0: nothing."""
    if not port:
        return
    host = host or metrics_host(os.environ)
    start_endpoints(host, port, registry, redis_url)
    log.info("metrics on %s:%d/metrics, health on /healthz and /readyz", host, port)
