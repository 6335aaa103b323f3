"""Checks at start that the collector's exposure and limits are what the operator meant.

* :func:`warn_exposure`: the dev profile takes unauthenticated input; listening
  beyond loopback in it is allowed (inside a pod or a compose network the
  network is the boundary) but said loudly, once, at start.
* :func:`check_open_files`: every HTTP connection, agent connection and open
  file takes a descriptor. With the common 1,024 soft limit, idle connections
  once starved ``/metrics`` silently; at start the soft limit is raised toward
  the hard one when it is below what the configured caps need, and a hard limit
  below that is a configuration error (exit 2) rather than a failure under load.

Example::

    >>> from gradwatch.collector.config import CollectorConfig
    >>> check_open_files(CollectorConfig()) >= 64 + RESERVED_FDS
    True
"""

from __future__ import annotations

import logging
import resource

from gradwatch.collector.auth import loopback
from gradwatch.collector.config import CollectorConfig, ConfigError, split_host_port

log = logging.getLogger(__name__)

# Descriptors besides HTTP connections: SQLite files and their WAL, ZeroMQ's own
# (context, reaper, command socket), logs, the allow-list watcher.
RESERVED_FDS = 64
# Agent connections (one per training process) the limit should leave room for.
AGENT_FDS = 1024


def _zmq_host(endpoint: str) -> str | None:
    if endpoint.startswith(("ipc://", "inproc://")):
        return None  # local by construction
    rest = endpoint.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0]


def exposed(config: CollectorConfig) -> list[str]:
    """The listening addresses of ``config`` that are not loopback."""
    found = []
    for name, endpoint in (("listen", config.listen), ("command_listen", config.command_listen)):
        host = _zmq_host(endpoint)
        if host is not None and not loopback(host):
            found.append(f"{name}={endpoint}")
    host = split_host_port(config.metrics_addr)[0]
    if not loopback(host):
        found.append(f"metrics_addr={config.metrics_addr}")
    return found


def warn_exposure(config: CollectorConfig) -> list[str]:
    """Log a warning when the dev profile listens beyond loopback; return what is exposed."""
    if config.profile != "dev":
        return []
    found = exposed(config)
    if found:
        log.warning(
            "the dev profile is listening beyond loopback (%s): anyone who can reach these "
            "ports can report any job, raise false alerts and read the metrics stream "
            "unauthenticated. Use profile: production with CurveZMQ keys (docs/deploy.md, "
            "SECURITY.md), or bind 127.0.0.1",
            ", ".join(found),
        )
    return found


def check_open_files(config: CollectorConfig) -> int:
    """Make the open-file soft limit cover the caps; return it. Raises ``ConfigError``."""
    need = config.http_max_connections + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need + AGENT_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(hard, want)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as exc:
                log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < need:
        raise ConfigError(
            f"the open-file limit is {soft} (hard {hard}), below the {need} descriptors that "
            f"http_max_connections={config.http_max_connections} and the collector's own "
            "files need; raise it (ulimit -n, LimitNOFILE=, or the container's nofile "
            "ulimit) or lower http_max_connections"
        )
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "the open-file limit is %d: room for about %d agent connections beyond "
            "HTTP's %d; raise it (ulimit -n) for jobs with more ranks",
            soft,
            soft - need,
            config.http_max_connections,
        )
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 30
