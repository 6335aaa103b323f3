"""``gradwatch keys``: file modes, no silent overwrite, the allow-list; production profile."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq.auth

from gradwatch.agent.config import AgentConfig, load_curve_keys
from gradwatch.cli import main
from gradwatch.collector.auth import production_problems
from gradwatch.collector.config import CollectorConfig, ConfigError
from gradwatch.collector.keys import load_allow_list, load_key_file
from tests.security.helpers import curve_config, make_keys, running


def test_generate_writes_a_zmq_compatible_pair_with_a_0600_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "generate", "--name", "collector", "--dir", str(tmp_path)]) == 0
    public_file, secret_file = tmp_path / "collector.key", tmp_path / "collector.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(secret_file)
    assert zmq.auth.load_certificate(public_file) == (public, None)
    assert secret is not None and zmq.curve_public(secret) == public
    assert public.decode() in capsys.readouterr().out
    # Never replaced by accident: the agents holding it would be locked out.
    assert main(["keys", "generate", "--name", "collector", "--dir", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert zmq.auth.load_certificate(secret_file)[1] == secret
    assert main(["keys", "generate", "--name", "collector", "--dir", str(tmp_path), "--force"]) == 0
    assert zmq.auth.load_certificate(secret_file)[1] != secret
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600


def test_allow_and_revoke_edit_the_allow_list(tmp_path: Path) -> None:
    assert main(["keys", "generate", "--name", "trainer", "--dir", str(tmp_path)]) == 0
    allow_file, public_file = tmp_path / "allow.yaml", tmp_path / "trainer.key"
    assert (
        main(
            [
                "keys",
                "allow",
                "--public",
                str(public_file),
                "--jobs",
                "run-*, eval-*",
                "--allow-file",
                str(allow_file),
            ]
        )
        == 0
    )
    public = zmq.auth.load_certificate(public_file)[0].decode()
    allow = load_allow_list(allow_file)
    assert allow.jobs_of(public) == ("run-*", "eval-*") and allow.name_of(public) == "trainer"
    assert main(["keys", "revoke", "--public", public, "--allow-file", str(allow_file)]) == 0
    assert load_allow_list(allow_file).jobs_of(public) is None
    assert main(["keys", "revoke", "--public", public, "--allow-file", str(allow_file)]) == 1


def test_bad_key_material_is_refused_with_a_reason(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    with pytest.raises(ConfigError, match="no secret key"):
        load_key_file(keys.collector.public_file, need_secret=True)
    secret = keys.collector.secret_file
    secret.chmod(0o604)  # readable by others
    with pytest.raises(ConfigError, match="chmod 600"):
        load_key_file(secret, need_secret=True)
    # Group-readable: only by the collector's own group (a Kubernetes secret volume's
    # fsGroup), never by another group, and never group-writable.
    secret.chmod(0o440)
    if secret.stat().st_gid == os.getegid():
        assert load_key_file(secret, need_secret=True)[1] is not None
        secret.chmod(0o460)
        with pytest.raises(ConfigError, match="chmod 600"):
            load_key_file(secret, need_secret=True)
    if os.geteuid() == 0:  # only root may hand a file to another group
        os.chown(secret, -1, os.getegid() + 4242)
        secret.chmod(0o440)
        with pytest.raises(ConfigError, match="chmod 600"):
            load_key_file(secret, need_secret=True)
    bad = tmp_path / "bad.yaml"
    bad.write_text("clients:\n  - public_key: short\n    jobs: [run-*]\n")
    with pytest.raises(ConfigError, match="40 Z85 characters"):
        load_allow_list(bad)


def test_production_without_keys_refuses_to_start(tmp_path: Path) -> None:
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", profile="production"
    )
    with pytest.raises(ConfigError) as refused, running(config):
        pass
    message = str(refused.value)
    assert "profile 'production' refuses to start" in message
    assert "curve_secret_key_file and curve_allow_file" in message


def test_production_rules(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    ok = curve_config(keys, profile="production")
    assert production_problems(ok, {"NaN": ("notify", "rollback")}) == [
        "rules NaN ask for rollback: set command_key_file (or remove the rollback action)"
    ]
    assert (
        production_problems(
            ok.model_copy(update={"command_key": "k" * 32}), {"NaN": ("notify", "rollback")}
        )
        == []
    )
    exposed = ok.model_copy(
        update={"metrics_addr": "0.0.0.0:9400", "webhooks": ["https://hooks.example/x"]}
    )
    problems = " ".join(production_problems(exposed, {}))
    assert "metrics_basic_auth_user" in problems and "metrics_tls_cert_file" in problems
    assert "webhook_secret_file" in problems
    # Keys, loopback metrics, no rollback rule: production starts.
    with running(ok) as server:
        assert server.ready


def test_agent_key_settings(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    config = AgentConfig(job="run-1", rank=0, world=1)
    assert load_curve_keys(config, env={}) is None
    env = {
        "GRADWATCH_CURVE_SERVER_KEY": keys.collector.public_key,  # Z85 text works too
        "GRADWATCH_AGENT_CURVE_SECRET_KEY_FILE": str(keys.trainer.secret_file),
    }
    curve = load_curve_keys(config, env=env)
    assert curve is not None and curve.server_public == keys.collector.public_key.encode()
    assert curve.public == keys.trainer.public_key.encode() and "secret" not in repr(curve)
    explicit = AgentConfig(
        job="run-1",
        rank=0,
        world=1,
        curve_server_public_key_file=str(keys.collector.public_file),
        curve_secret_key_file=str(keys.trainer.secret_file),
    )
    assert load_curve_keys(explicit, env={}) == curve
    with pytest.raises(ValueError, match="only one is set"):
        load_curve_keys(config, env={"GRADWATCH_CURVE_SERVER_KEY": keys.collector.public_key})
    with pytest.raises(ValueError, match="holds no secret key"):
        load_curve_keys(
            config,
            env={**env, "GRADWATCH_AGENT_CURVE_SECRET_KEY_FILE": str(keys.trainer.public_file)},
        )
