"""A small Grafana HTTP API on 127.0.0.1 that enforces what the real one documents.

Implemented from Grafana's HTTP API reference (dashboards and annotations):

- every ``/api`` request needs ``Authorization: Bearer <token>``: 401
  ``{"message": "Unauthorized"}`` otherwise;
- request bodies must be JSON (``Content-Type: application/json``): 400 otherwise;
- ``POST /api/dashboards/db`` needs ``dashboard.title`` (400 without); a
  dashboard whose uid exists is replaced when ``overwrite`` is true, else a
  version differing from the stored one answers 412 ``{"status":
  "version-mismatch"}``; success is 200 ``{id, uid, url, status, version, slug}``;
- ``POST /api/annotations`` needs a non-empty ``text`` (400) and answers
  ``{"message": "Annotation added", "id": N}``;
- ``PATCH /api/annotations/:id`` updates only the fields sent (404 for an
  unknown id) and answers ``{"message": "Annotation patched"}``;
- ``GET /api/annotations?tags=...`` lists annotations having every tag;
- anything else is 404.

Example::

    with FakeGrafana(token="t") as grafana:
        print(grafana.url)      # http://127.0.0.1:PORT
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

ANNOTATION_PATH = re.compile(r"^/api/annotations/(\d+)$")


class FakeGrafana:
    """Serves from a thread once entered; state is readable from the test."""

    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.annotations: dict[int, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.changed = threading.Condition()
        self._ids = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeGrafana:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> bool:
        """Block until ``predicate(self)`` holds after a request, or ``timeout``."""
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout)

    # ------------------------------------------------------------ API handlers

    def save_dashboard(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        dashboard = body.get("dashboard")
        if not isinstance(dashboard, dict) or not dashboard.get("title"):
            return 400, {"message": "Dashboard title cannot be empty", "status": "empty-name"}
        uid = dashboard.get("uid") or f"gen{next(self._ids)}"
        stored = self.dashboards.get(uid)
        if (
            stored is not None
            and not body.get("overwrite", False)
            and dashboard.get("version") != stored["dashboard"]["version"]
        ):
            return 412, {
                "message": "The dashboard has been changed by someone else",
                "status": "version-mismatch",
            }
        version = 1 if stored is None else stored["dashboard"]["version"] + 1
        ident = stored["id"] if stored is not None else next(self._ids)
        slug = re.sub(r"[^a-z0-9]+", "-", dashboard["title"].lower()).strip("-")
        self.dashboards[uid] = {
            "id": ident,
            "folderUid": body.get("folderUid"),
            "dashboard": {**dashboard, "id": ident, "uid": uid, "version": version},
        }
        return 200, {
            "id": ident,
            "uid": uid,
            "url": f"/d/{uid}/{slug}",
            "status": "success",
            "version": version,
            "slug": slug,
        }

    def add_annotation(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not isinstance(body.get("text"), str) or not body["text"]:
            return 400, {"message": "text field should not be empty"}
        ident = next(self._ids)
        self.annotations[ident] = {
            "id": ident,
            "time": body.get("time"),
            "timeEnd": body.get("timeEnd"),
            "tags": list(body.get("tags") or []),
            "text": body["text"],
            "dashboardUID": body.get("dashboardUID"),
            "panelId": body.get("panelId"),
        }
        return 200, {"message": "Annotation added", "id": ident}

    def patch_annotation(self, ident: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        annotation = self.annotations.get(ident)
        if annotation is None:
            return 404, {"message": "Could not find annotation to update"}
        for key in ("time", "timeEnd", "tags", "text"):
            if key in body:
                annotation[key] = body[key]
        return 200, {"message": "Annotation patched"}

    def find_annotations(self, query: str) -> tuple[int, Any]:
        tags = set(parse_qs(query).get("tags", []))
        return 200, [a for a in self.annotations.values() if tags <= set(a["tags"])]


def _handler(grafana: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            with grafana.changed:
                grafana.requests.append((method, parts.path))
                status, answer = self._route(method, parts.path, parts.query, raw)
                grafana.changed.notify_all()
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str, path: str, query: str, raw: bytes) -> tuple[int, Any]:
            if self.headers.get("Authorization") != f"Bearer {grafana.token}":
                return 401, {"message": "Unauthorized"}
            body: dict[str, Any] = {}
            if method != "GET":
                if not (self.headers.get("Content-Type") or "").startswith("application/json"):
                    return 400, {"message": "bad request data: Content-Type must be JSON"}
                try:
                    body = json.loads(raw)
                except ValueError:
                    return 400, {"message": "bad request data"}
                if not isinstance(body, dict):
                    return 400, {"message": "bad request data"}
            match = ANNOTATION_PATH.match(path)
            if method == "POST" and path == "/api/dashboards/db":
                return grafana.save_dashboard(body)
            if method == "POST" and path == "/api/annotations":
                return grafana.add_annotation(body)
            if method == "GET" and path == "/api/annotations":
                return grafana.find_annotations(query)
            if method == "PATCH" and match:
                return grafana.patch_annotation(int(match.group(1)), body)
            return 404, {"message": "Not found"}

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep test output clean

    return Handler
