"""``freshrec dashboard``: a live web page of the running services' headline figures.

It scrapes each service's /metrics itself (``freshrec/app/observe.py``) once a second and serves
``/`` (one self-contained HTML page, no external scripts) and ``/api/series`` (JSON). Binds to
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from freshrec.app.observe import Observer, Poller

log = logging.getLogger("freshrec.app.dashboard")


def page() -> bytes:
    return resources.files("freshrec.app").joinpath("web/dashboard.html").read_bytes()


class DashboardServer:
    def __init__(self, observer: Observer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.observer = observer
        html = page()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", html)
                elif self.path.startswith("/api/series"):
                    body = json.dumps(observer.series()).encode()
                    self._send(200, "application/json", body)
                else:
                    self._send(404, "text/plain", b"not found")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args) -> None:
                log.debug(fmt, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.poller = Poller(observer)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, daemon=True, name="dashboard"
        )

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> DashboardServer:
        self.poller.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.poller.stop()
        self.httpd.shutdown()
        self.httpd.server_close()
