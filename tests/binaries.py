"""System binaries the integration tests need, found or explained.

Locally a missing binary skips the test with the command that installs it; in
CI (``CI=true``) it fails instead, so a broken set-up can never pass as skips.

Example::

    from tests.binaries import require_binary

    promtool = require_binary("promtool")
"""

from __future__ import annotations

import os
import shutil

import pytest

# Debian names the Alertmanager binary after its package.
ALIASES: dict[str, tuple[str, ...]] = {
    "alertmanager": ("alertmanager", "prometheus-alertmanager"),
    "prometheus-alertmanager": ("prometheus-alertmanager", "alertmanager"),
    "chromium": ("chromium", "chromium-browser"),
}
PACKAGES: dict[str, str] = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "alertmanager": "prometheus-alertmanager",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
    "chromium": "chromium",
}
SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/usr/local/bin"]
)


def find_binary(name: str) -> str | None:
    for candidate in ALIASES.get(name, (name,)):
        found = shutil.which(candidate, path=SEARCH_PATH)
        if found:
            return found
    return None


def require_binary(name: str) -> str:
    """The absolute path of ``name``; skip (locally) or fail (CI) when it is missing."""
    found = find_binary(name)
    if found:
        return found
    package = PACKAGES.get(name, name)
    message = (
        f"{name} is not installed; `bash run.sh setup` installs it, or "
        f"`apt-get install -y {package}`"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI must not skip this test)")
    pytest.skip(message)
