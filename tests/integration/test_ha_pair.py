"""An HA pair of collectors firing the same alert through a two-replica Alertmanager cluster.

A real training loop watched by one agent feeds both collectors of an HA pair
(``endpoint="<collector-a>,<collector-b>"``: agent/destinations.py sends every
message to each), and both post their alerts to both Alertmanager replicas, which
gossip on loopback (``--cluster.listen-address``/``--cluster.peer``). The alert
a collector builds carries no collector identity (collector/alertmanager.py:
alertname, severity, category, training_job, job, rank and the rule's labels),
so both collectors' alerts are one alert in Alertmanager, and the cluster's
notification log makes the pair of replicas send it once: exactly one firing
and one resolved notification reach the webhook for the incident, while both
replicas hold the alert. deploy/fleet/ runs the same shape.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from prometheus_client import CollectorRegistry

import gradwatch
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.server import Server
from tests.binaries import require_binary
from tests.integration.promstack import alertmanager_config, free_port, http_get, wait_until

JOB = "it-ha-pair"
RULE = "NonFiniteGradients"
NAN_STEP = 7
STEPS = 12
TIMEOUT_S = 40.0
PEER_TIMEOUT_S = 1.0  # how long the second replica waits for the first one's notification
# Each replica flushes a group every group interval and notifies when its own view differs
# from the cluster's notification log. The resolve is sent right after the firing
# notification (a flush), so it reaches both replicas long before their next flush;
# a resolve landing on one replica just before a flush and on the other just after
# would make the second send its (still firing) view again: see deploy/fleet/README.md.
GROUP_INTERVAL_S = 5.0
# After the incident resolved: long enough for a second replica's duplicate, had
# the gossip failed (it would send one peer timeout after the first, plus a group interval).
QUIET_WINDOW_S = 4 * PEER_TIMEOUT_S + 2.0


@contextmanager
def alertmanager_cluster(workdir: Path, webhook_url: str, replicas: int = 2) -> Iterator[list[str]]:
    """``replicas`` Alertmanagers gossiping on loopback; yields their base URLs."""
    binary = require_binary("alertmanager")
    config = alertmanager_config(webhook_url)
    for route in [config["route"], *config["route"].get("routes", ())]:
        route["repeat_interval"] = "1h"  # no repeat inside the test: one page per incident
        route["group_interval"] = f"{GROUP_INTERVAL_S:g}s"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
    web = [free_port() for _ in range(replicas)]
    gossip = [free_port() for _ in range(replicas)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(replicas):
            peers = [f"--cluster.peer=127.0.0.1:{p}" for j, p in enumerate(gossip) if j != i]
            with (workdir / f"am{i}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            binary,
                            f"--config.file={workdir / 'alertmanager.yml'}",
                            f"--storage.path={workdir / f'data{i}'}",
                            f"--web.listen-address=127.0.0.1:{web[i]}",
                            f"--cluster.listen-address=127.0.0.1:{gossip[i]}",
                            f"--cluster.advertise-address=127.0.0.1:{gossip[i]}",
                            f"--cluster.peer-timeout={PEER_TIMEOUT_S:g}s",
                            "--cluster.gossip-interval=100ms",
                            "--cluster.pushpull-interval=1s",
                            *peers,
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        urls = [f"http://127.0.0.1:{p}" for p in web]
        for url in urls:
            wait_until(
                lambda url=url: _peers(url) if _peers(url) == replicas else None,
                TIMEOUT_S,
                f"{url}: a cluster of {replicas} peers",
            )
        yield urls
    except BaseException:
        for i in range(len(procs)):
            print((workdir / f"am{i}.log").read_text(errors="replace")[-2000:])
        raise
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _peers(url: str) -> int | None:
    try:
        status = json.loads(http_get(f"{url}/api/v2/status"))
    except OSError:
        return None
    return len(status.get("cluster", {}).get("peers") or [])


@contextmanager
def collector(alertmanagers: Sequence[str]) -> Iterator[Server]:
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        alertmanager_urls=list(alertmanagers),
        job_ttl_seconds=60.0,
    )
    server = Server(config, registry=CollectorRegistry())
    server.start()
    try:
        yield server
    finally:
        assert server.stop(10), "the collector did not stop within its deadline"


def wait_for_job(pair: Sequence[Server], deadline_s: float) -> None:
    """Until both collectors have heard the agent (its first heartbeat): the agent's
    sockets queue nothing for a peer not connected yet (ZMQ_IMMEDIATE)."""
    wait_until(
        lambda: True if all(c.state.job(JOB) is not None for c in pair) else None,
        deadline_s,
        "the agent's first heartbeat at both collectors of the pair",
    )


def train(
    run: tuple[gradwatch.Monitor, torch.nn.Module, Any], pair: Sequence[Server], steps: range
) -> None:
    """Steps of a real loop; at ``NAN_STEP`` the gradients go NaN and the optimizer step is
    skipped (as a GradScaler skips an overflow), so training goes on clean after it. Each
    step reaches both collectors before the next: a loop that outran the agent's pool of
    host buffers would have a step dropped by design, which is not what this tests."""
    mon, model, opt = run
    for step in steps:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if step == NAN_STEP:
            loss = loss * float("nan")
        loss.backward()
        if step != NAN_STEP:
            opt.step()
        mon.log(loss=loss.detach() if step != NAN_STEP else 1.0)  # log() reads skipped grads
        opt.zero_grad()
        wait_until(
            lambda s=step: True if all(_latest(c) >= s for c in pair) else None,
            TIMEOUT_S,
            f"step {step} at both collectors",
        )


def _latest(server: Server) -> int:
    job = server.state.job(JOB)
    rank = job.ranks.get(0) if job is not None else None
    return rank.latest.step if rank is not None and rank.latest is not None else 0


def _ours(bodies: list[Any], status: str) -> list[dict[str, Any]]:
    """Our alert in each notification with ``status`` (one entry per notification)."""
    return [
        alert
        for body in bodies
        for alert in body.get("alerts", ())
        if alert["status"] == status
        and alert["labels"].get("alertname") == RULE
        and alert["labels"].get("training_job", alert["labels"].get("job")) == JOB
    ]


def _held(url: str) -> list[dict[str, Any]]:
    """Our alerts a replica holds (active or already resolved)."""
    alerts = json.loads(http_get(f"{url}/api/v2/alerts"))
    return [a for a in alerts if a["labels"].get("alertname") == RULE]


def test_one_notification_per_incident_from_an_ha_pair(tmp_path: Path) -> None:
    with (
        WebhookReceiver() as receiver,
        alertmanager_cluster(tmp_path / "am", receiver.url) as ams,
        ExitStack() as stack,
    ):
        pair = [stack.enter_context(collector(ams)) for _ in range(2)]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        endpoint = ",".join(c.bound_endpoint for c in pair)
        mon = gradwatch.watch(model, opt, job=JOB, endpoint=endpoint, flush_every=1)
        stack.callback(mon.close)
        wait_for_job(pair, TIMEOUT_S)
        train((mon, model, opt), pair, range(1, NAN_STEP + 1))  # up to the NaN: it fires
        receiver.wait_for(lambda bodies: bool(_ours(bodies, "firing")), TIMEOUT_S)
        # Both collectors fired it to both replicas: each replica holds it, as one alert.
        for url in ams:
            held = _held(url)
            assert len(held) == 1 and held[0]["labels"]["rank"] == "0", held
        for server in pair:
            assert [sink.stats().delivered for sink in server.sinks] == [1] * len(ams)
        train((mon, model, opt), pair, range(NAN_STEP + 1, STEPS + 1))  # clean: resolved
        receiver.wait_for(lambda bodies: bool(_ours(bodies, "resolved")), TIMEOUT_S)
        # A duplicate from the second replica would come within the window; none may.
        try:
            receiver.wait_for(
                lambda bodies: (
                    len(_ours(bodies, "firing")) > 1 or len(_ours(bodies, "resolved")) > 1
                ),
                QUIET_WINDOW_S,
            )
        except TimeoutError:
            pass
        bodies = receiver.bodies
    assert len(_ours(bodies, "firing")) == 1, bodies
    assert len(_ours(bodies, "resolved")) == 1, bodies
