"""Prometheus Alertmanager (API v2): gradwatch alerts routed, grouped and silenced there.

``POST {base}/api/v2/alerts`` with a JSON list of postable alerts: ``labels``
(``alertname`` = the rule, ``severity``, ``category``, ``training_job`` and, for
routes written before it, ``job`` (both the training job), ``rank``, plus
the rule's own labels), ``annotations`` (``summary``, ``description``,
``diagnosis``), ``startsAt``, ``endsAt`` and ``generatorURL``. Alertmanager
forgets an alert that is not updated, so while an alert fires it is posted
again every ``resend_interval`` seconds (60 by default) with ``endsAt`` four
intervals ahead, as Prometheus does; if the collector dies, its alerts expire
on their own. A resolve is posted with ``endsAt`` = the resolve time.

The first firing and the resolve go through the durable outbox; the periodic
re-posts are best effort (the next one follows soon) and bypass the rate limit.

Example::

    from gradwatch.collector.alertmanager import AlertmanagerSink

    sink = AlertmanagerSink("http://alertmanager:9093")
    sink.start()
    # for transition in engine.observe(step): sink.notify(transition)
    sink.close(timeout=5.0)
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gradwatch.collector.config import VERSION
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.outbox_store import Outbox
from gradwatch.collector.pagerduty import iso8601
from gradwatch.collector.sinks import alert_payload, mask_url
from gradwatch.collector.webhook import HttpRequest

log = logging.getLogger(__name__)

API_PATH = "/api/v2/alerts"
DEFAULT_RESEND_S = 60.0
VALID_FOR_RESENDS = 4  # endsAt of a firing alert: this many resend intervals ahead


def alertmanager_alert(
    alert: Mapping[str, Any], now: float, valid_for: float, generator_url: str | None = None
) -> dict[str, Any]:
    """One postable alert for ``alert`` (``Alert.to_dict()`` form) as of ``now``."""
    labels = {str(k): str(v) for k, v in (alert.get("labels") or {}).items()}
    # training_job, as on the collector's metrics and Prometheus' gradwatch alerts, so one
    # inhibition or route matches both; job (the same value) stays for existing routes.
    labels.update(
        {
            "alertname": alert["rule"],
            "severity": alert["severity"],
            "category": alert["category"],
            "training_job": alert["job"],
            "job": alert["job"],
        }
    )
    if alert.get("rank") is not None:
        labels["rank"] = str(alert["rank"])
    annotations = {str(k): str(v) for k, v in (alert.get("annotations") or {}).items()}
    annotations["summary"] = str(alert["summary"])
    annotations["description"] = (
        f"{alert['rule']} ({alert['category']}) on job {alert['job']} since step "
        f"{alert['step']}; evidence: {json.dumps(alert.get('evidence') or {})}"
    )
    diagnosis = alert.get("diagnosis")
    if diagnosis:
        checks = "; ".join(diagnosis.get("next_checks") or ())
        annotations["diagnosis"] = f"{diagnosis.get('verdict', '?')}. Next checks: {checks}"
    if alert["state"] == "firing":
        ends = now + valid_for
    else:
        resolved = alert.get("resolved_at")
        ends = resolved if isinstance(resolved, (int, float)) else now
    started = alert.get("started_at")
    body: dict[str, Any] = {
        "labels": labels,
        "annotations": annotations,
        "startsAt": iso8601(started if isinstance(started, (int, float)) else now),
        "endsAt": iso8601(ends),
    }
    if generator_url:
        body["generatorURL"] = generator_url
    return body


class AlertmanagerChannel:
    """POSTs alerts to ``{base}/api/v2/alerts``."""

    def __init__(
        self,
        url: str,
        *,
        resend_interval: float = DEFAULT_RESEND_S,
        generator_url: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        self._url = url.rstrip("/") + API_PATH
        self._valid_for = VALID_FOR_RESENDS * resend_interval
        self._generator_url = generator_url
        self._timeout = timeout
        self.target = f"Alertmanager {mask_url(url)}"

    def post(self, alerts: Sequence[Mapping[str, Any]], now: float) -> HttpRequest:
        """One request carrying every alert in ``alerts``."""
        body = [alertmanager_alert(a, now, self._valid_for, self._generator_url) for a in alerts]
        return HttpRequest(
            self._url,
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "User-Agent": f"gradwatch/{VERSION}"},
            self._timeout,
        )

    def request(self, notification_id: str, alert: Mapping[str, Any], now: float) -> HttpRequest:
        return self.post([alert], now)

    def __repr__(self) -> str:
        return f"AlertmanagerChannel({self.target!r})"


class AlertmanagerSink(OutboxSink):
    """An :class:`OutboxSink` that also re-posts its firing alerts every ``resend_interval``."""

    # Alertmanager applies the rules' inhibits itself (its inhibit_rules), and notifies a
    # muted alert once its source resolves: it gets every transition (collector/inhibition.py).
    gets_muted = True

    def __init__(
        self,
        url: str,
        *,
        name: str = "alertmanager",
        outbox: Outbox | None = None,
        resend_interval: float = DEFAULT_RESEND_S,
        generator_url: str | None = None,
        timeout: float = 5.0,
        **options: Any,
    ) -> None:
        channel = AlertmanagerChannel(
            url, resend_interval=resend_interval, generator_url=generator_url, timeout=timeout
        )
        super().__init__(name, channel, outbox, **options)
        self._am = channel
        self._resend = resend_interval
        self._firing: dict[str, dict[str, Any]] = {}
        self._firing_lock = threading.Lock()
        self._next_resend = 0.0
        self.reposts = 0

    def _admitted(self, alert: Any) -> None:
        with self._firing_lock:
            if alert.state == "firing":
                if not self._firing:  # the first re-post comes one interval after, not at once
                    self._next_resend = self._clock() + self._resend
                self._firing[alert.id] = alert_payload(alert)
            else:
                self._firing.pop(alert.id, None)

    def firing(self) -> list[str]:
        """Ids of the alerts this sink keeps posting."""
        with self._firing_lock:
            return list(self._firing)

    def _periodic(self, now: float) -> float:
        with self._firing_lock:
            alerts = list(self._firing.values())
        if not alerts:
            return self._resend
        if now < self._next_resend:
            return self._next_resend - now
        self._next_resend = now + self._resend
        try:
            response = self._transport(self._am.post(alerts, now))
            problem = "" if 200 <= response.status < 300 else f"HTTP {response.status}"
        except Exception as exc:  # best effort: the next re-post follows
            problem = str(exc) or type(exc).__name__
        if problem:
            log.warning(
                "%s: re-posting %d firing alert(s) to %s failed (%s); retrying in %.0fs",
                self.name,
                len(alerts),
                self.channel.target,
                problem,
                self._resend,
            )
        else:
            self.reposts += 1
        return self._resend
