"""Grafana: push the gradwatch dashboard, and mark alerts on it as annotations.

``push_dashboard`` sends a dashboard JSON file to ``POST /api/dashboards/db``.
``GrafanaAnnotationSink`` is a sink (see ``gradwatch.collector.sinks``): each
alert that fires becomes an annotation (``POST /api/annotations``) at the
alert's start, tagged ``gradwatch``, job, rule, category and severity; when
the alert resolves the same annotation gets its ``timeEnd`` (``PATCH
/api/annotations/:id``), so Grafana draws the incident as a region. The
dashboard's annotation query filters on the ``gradwatch`` tag. Both talk to
Grafana through the ``grafana-client`` library with a service-account token
(``Authorization: Bearer``); HTTP errors become one ``GrafanaError`` saying
what to do. The sink never blocks ``notify``: a bounded queue and its own
thread, so a Grafana that is down or slow costs counted failures, nothing else.

Example::

    from gradwatch.collector.grafana import GrafanaAnnotationSink, push_dashboard

    push_dashboard("http://grafana:3000", token, "collector/dashboards/gradwatch.json")
    sink = GrafanaAnnotationSink("http://grafana:3000", token)
    sink.start()
    # for transition in engine.observe(step): sink.notify(transition)
    sink.close(timeout=5.0)
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

from gradwatch.collector.config import CollectorConfig, CollectorError
from gradwatch.collector.sinks import NOTIFY_STATES, SinkStats, mask_url, read_secret

log = logging.getLogger(__name__)

MAX_TRACKED = 4096  # firing annotations remembered for their resolve (oldest forgotten)
RETRY_DELAYS = (0.5, 2.0)  # seconds between attempts; a close cuts them short


class GrafanaError(CollectorError):
    """Grafana refused a request or could not be reached; the message says what to do.

    ``retryable`` is False when trying again cannot help (a refused token, a bad request).
    """

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def grafana_api(url: str, token: str, timeout: float = 5.0) -> GrafanaApi:
    """A ``GrafanaApi`` for ``url`` (``http(s)://host[:port][/prefix]``) with a bearer token."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GrafanaError(
            f"Grafana URL {url!r} is not an http:// or https:// URL with a host; "
            "pass e.g. --url http://grafana:3000"
        )
    # grafana-client joins the prefix and "api" without a separator.
    prefix = parts.path.strip("/")
    return GrafanaApi(
        auth=token,
        host=parts.hostname,
        port=parts.port,
        protocol=parts.scheme,
        url_path_prefix=f"{prefix}/" if prefix else "",
        timeout=timeout,
    )


@contextmanager
def _translated(what: str, url: str) -> Iterator[None]:
    """Turn grafana-client's and the HTTP library's errors into ``GrafanaError``."""
    where = mask_url(url)
    try:
        yield
    except GrafanaUnauthorizedError as exc:
        raise GrafanaError(
            f"{what}: Grafana at {where} answered 401 Unauthorized; the token is missing, "
            "wrong or expired: create a service-account token with the Editor role and pass "
            "it with --token-file or GRADWATCH_GRAFANA_TOKEN",
            retryable=False,
        ) from exc
    except GrafanaClientError as exc:
        hint = (
            "the dashboard changed in Grafana since this file was exported; pass "
            "overwrite=True (drop --no-overwrite) to replace it"
            if exc.status_code == 412
            else "check the request and the token's permissions"
        )
        raise GrafanaError(
            f"{what}: Grafana at {where} answered {exc.status_code}: {exc.message}; {hint}",
            retryable=exc.status_code in (408, 429),
        ) from exc
    except GrafanaException as exc:
        raise GrafanaError(
            f"{what}: Grafana at {where} failed: {exc.message}; check Grafana's logs and retry"
        ) from exc
    except OSError as exc:  # niquests' ConnectionError and Timeout derive from OSError
        raise GrafanaError(
            f"{what}: cannot reach Grafana at {where} ({type(exc).__name__}); "
            "check the URL and that Grafana is up"
        ) from exc


def load_dashboard(path: Path) -> dict[str, Any]:
    """The dashboard model in ``path``: a bare dashboard or an export ``{"dashboard": ...}``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise GrafanaError(
            f"cannot read dashboard {path}: {exc.strerror or exc}; "
            "pass the JSON file with --dashboard"
        ) from exc
    except json.JSONDecodeError as exc:
        raise GrafanaError(f"dashboard {path} is not valid JSON: {exc}") from exc
    dashboard = data.get("dashboard", data) if isinstance(data, dict) else None
    if not isinstance(dashboard, dict) or not dashboard.get("title"):
        raise GrafanaError(
            f"dashboard {path} has no title; a Grafana dashboard model is a JSON "
            'object with at least a "title"'
        )
    return dashboard


def push_dashboard(
    url: str,
    token: str,
    path: Path | str,
    folder_uid: str | None = None,
    overwrite: bool = True,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Create or replace the dashboard in ``path``; returns Grafana's answer
    (``id``, ``uid``, ``url``, ``status``, ``version``). Raises ``GrafanaError``."""
    dashboard = dict(load_dashboard(Path(path)))
    # Grafana matches by uid; a numeric id from another instance would point elsewhere.
    dashboard["id"] = None
    payload: dict[str, Any] = {
        "dashboard": dashboard,
        "overwrite": overwrite,
        "message": "pushed by gradwatch grafana push",
    }
    if folder_uid is not None:
        payload["folderUid"] = folder_uid
    with _translated(f"pushing dashboard {dashboard['title']!r}", url):
        answer = grafana_api(url, token, timeout).dashboard.update_dashboard(payload)
    return dict(answer)


def alert_tags(alert: Any) -> list[str]:
    """The tags every gradwatch annotation carries; the dashboard filters on the first."""
    return [
        "gradwatch",
        f"job:{alert.job}",
        f"rule:{alert.rule}",
        f"category:{alert.category}",
        f"severity:{alert.severity}",
    ]


def alert_text(alert: Any) -> str:
    """Summary, then the diagnosis' verdict and its own summary when there is one."""
    lines = [f"[{alert.severity}] {alert.rule}: {alert.summary}"]
    diagnosis = alert.diagnosis or {}
    if diagnosis.get("verdict"):
        lines.append(
            f"diagnosis: {diagnosis['verdict']}"
            + (f" - {diagnosis['summary']}" if diagnosis.get("summary") else "")
        )
    return "\n".join(lines)


class GrafanaAnnotationSink:
    """Posts one region annotation per alert incident from a background thread."""

    # An annotation records what happened on the dashboard, not a page: a muted alert
    # (collector/inhibition.py) opened all the same, so it is annotated too.
    gets_muted = True

    def __init__(
        self,
        url: str,
        token: str,
        *,
        name: str = "grafana",
        dashboard_uid: str | None = None,
        timeout: float = 5.0,
        queue_size: int = 1024,
        retry_delays: tuple[float, ...] = RETRY_DELAYS,
    ) -> None:
        self.name = name
        self._url = url
        self._masked = mask_url(url)
        self._api = grafana_api(url, token, timeout)
        self._dashboard_uid = dashboard_uid
        self._retry_delays = retry_delays
        self._queue: deque[tuple[str, Any]] = deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._annotation_ids: OrderedDict[str, int] = OrderedDict()
        self._counts = {"delivered": 0, "failed": 0, "dropped": 0, "retries": 0}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"gradwatch-{self.name}", daemon=True
            )
            self._thread.start()

    def notify(self, transition: Any) -> None:
        """Queue a firing or resolved transition; never blocks, drops the oldest when full."""
        if transition.current not in NOTIFY_STATES:
            return
        with self._cond:
            if self._closing.is_set():
                return
            if len(self._queue) >= self._queue_size:
                self._queue.popleft()
                self._counts["dropped"] += 1
                if self._counts["dropped"] == 1:
                    log.warning(
                        "grafana %s: annotation queue full (%d), dropping the oldest; "
                        "Grafana is too slow or down",
                        self._masked,
                        self._queue_size,
                    )
            self._queue.append((transition.current, transition.alert))
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Send what is queued (one attempt each) within ``timeout``, then stop."""
        with self._cond:
            self._closing.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "grafana %s: still sending after %.1fs at shutdown; giving up",
                    self._masked,
                    timeout,
                )
        self._api.client.s.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> SinkStats:
        with self._cond:
            return self._stats()

    def wait_for(self, predicate: Callable[[SinkStats], bool], timeout: float) -> SinkStats:
        """Block until ``predicate(stats)`` holds or ``timeout`` passes; the stats then."""
        with self._cond:
            self._cond.wait_for(lambda: predicate(self._stats()), timeout)
            return self._stats()

    def _stats(self) -> SinkStats:
        return SinkStats(queued=len(self._queue), **self._counts)

    def annotation_id(self, alert_id: str) -> int | None:
        """The Grafana annotation id of a firing incident, if it was posted."""
        with self._cond:
            return self._annotation_ids.get(alert_id)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing.is_set():
                    self._cond.wait()
                if not self._queue:
                    return
                state, alert = self._queue.popleft()
            try:
                outcome = self._deliver(state, alert)
            except Exception:  # a bug here must not end annotations for good
                log.exception("grafana %s: failed to annotate %r", self._masked, alert)
                outcome = "failed"
            with self._cond:
                self._counts[outcome] += 1
                self._cond.notify_all()

    def _deliver(self, state: str, alert: Any) -> str:
        for attempt in range(len(self._retry_delays) + 1):
            try:
                with _translated(
                    f"annotating {state} alert {alert.rule} of job {alert.job!r}", self._url
                ):
                    self._send(state, alert)
                return "delivered"
            except GrafanaError as exc:
                last = attempt == len(self._retry_delays)
                if last or not exc.retryable or self._closing.is_set():
                    log.warning("grafana %s: gave up: %s", self._masked, exc)
                    return "failed"
            with self._cond:
                self._counts["retries"] += 1
                self._cond.notify_all()
            self._closing.wait(self._retry_delays[attempt])
        return "failed"

    def _send(self, state: str, alert: Any) -> None:
        annotations = self._api.annotations
        with self._cond:
            known = self._annotation_ids.get(alert.id)
        if state == "resolved" and known is not None:
            # PATCH only timeEnd: grafana-client's helper would also send empty tags.
            end = _ms(alert.resolved_at if alert.resolved_at is not None else alert.started_at)
            annotations.client.PATCH(f"/annotations/{known}", json={"timeEnd": end})
            with self._cond:
                self._annotation_ids.pop(alert.id, None)
            return
        # A resolve without a known firing annotation (it failed, or a restart
        # lost the id) still gets its region, posted whole.
        until = _ms(alert.resolved_at) if state == "resolved" and alert.resolved_at else None
        answer = annotations.add_annotation(
            dashboard_uid=self._dashboard_uid,
            time_from=_ms(alert.started_at),
            time_to=until,
            tags=alert_tags(alert),
            text=alert_text(alert),
        )
        if state == "firing":
            with self._cond:
                self._annotation_ids[alert.id] = int(answer["id"])
                while len(self._annotation_ids) > MAX_TRACKED:
                    self._annotation_ids.popitem(last=False)


def _ms(seconds: float) -> int:
    """Grafana's annotation times are epoch milliseconds."""
    return round(seconds * 1000)


def build_grafana_sinks(config: CollectorConfig) -> list[GrafanaAnnotationSink]:
    """The annotation sink when ``grafana_url`` and a token are configured, else none."""
    if config.grafana_url is None:
        return []
    token = read_secret(config.grafana_token, config.grafana_token_file, "grafana_token")
    if not token:
        raise GrafanaError(
            "grafana_url is set but no token: set GRADWATCH_GRAFANA_TOKEN or "
            "grafana_token_file (a service-account token with the Editor role)"
        )
    return [
        GrafanaAnnotationSink(
            config.grafana_url,
            token,
            dashboard_uid=config.grafana_dashboard_uid,
            timeout=config.webhook_timeout,
            queue_size=config.webhook_queue_size,
        )
    ]
