"""CurveZMQ key files and the collector's allow-list: ``gradwatch keys``.

Key pairs are written in ZeroMQ's certificate format, so
``zmq.auth.load_certificate`` reads them: ``NAME.key`` holds the public key
(share it) and ``NAME.key_secret`` holds both keys (keep it; created with mode
0600, never overwritten without ``--force``).

The allow-list is a small YAML file that the collector reads (setting
``curve_allow_file``) and re-reads when it changes. Each client public key
(Z85, 40 characters) maps to the job names it may report, as glob patterns::

    version: 1
    clients:
      - name: trainer-a
        public_key: "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
        jobs: ["run-*", "eval-*"]

Example::

    from pathlib import Path
    from gradwatch.collector.keys import allow_key, generate_keypair, load_allow_list

    pair = generate_keypair("trainer-a", Path("keys"))
    allow_key(Path("allow.yaml"), pair.public_key, ["run-*"], name="trainer-a")
    print(load_allow_list(Path("allow.yaml")).jobs_of(pair.public_key))   # ('run-*',)
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
import zmq
import zmq.auth
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gradwatch.collector.config import ConfigError

SECRET_MODE = 0o600
Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_BANNER = (
    "#   ****  Generated on {now} by gradwatch keys  ****\n"
    "#   ZeroMQ CURVE {what}\n#   {advice}\n\n"
)


@dataclass(frozen=True, slots=True)
class KeyPair:
    """Where ``generate_keypair`` wrote a pair, and the public key (Z85 text)."""

    public_file: Path
    secret_file: Path
    public_key: str


class Client(BaseModel):
    """One allowed agent key and the jobs (glob patterns) it may report."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    public_key: str
    jobs: tuple[str, ...] = Field(min_length=1)
    name: str = ""

    @field_validator("public_key")
    @classmethod
    def _z85(cls, value: str) -> str:
        if not Z85_KEY.match(value):
            raise ValueError(
                "must be a CurveZMQ public key: 40 Z85 characters, as in a "
                "NAME.key file written by `gradwatch keys generate`"
            )
        return value


class AllowList(BaseModel):
    """The parsed allow-list file; ``jobs_of`` is what the collector asks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 1
    clients: tuple[Client, ...] = ()

    def jobs_of(self, public_key: str) -> tuple[str, ...] | None:
        """The job patterns of ``public_key``, or None when it is not listed."""
        for client in self.clients:
            if client.public_key == public_key:
                return client.jobs
        return None

    def name_of(self, public_key: str) -> str:
        for client in self.clients:
            if client.public_key == public_key:
                return client.name or public_key[:8]
        return public_key[:8]


# ---------------------------------------------------------------- key pairs


def generate_keypair(name: str, directory: Path, force: bool = False) -> KeyPair:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) into ``directory``.

    Raises ``ConfigError`` when a file exists (pass ``force=True`` to replace
    it) or cannot be written.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
        raise ConfigError(f"key name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    public, secret = zmq.curve_keypair()
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    existing = [str(f) for f in (public_file, secret_file) if f.exists()]
    if existing and not force:
        raise ConfigError(
            f"{' and '.join(existing)} already exist(s); pass --force to replace "
            "(agents holding the old key are refused until they get the new one)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write(
            secret_file,
            _BANNER.format(
                now=now,
                what="secret certificate",
                advice="DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
            )
            + _curve_section(public, secret),
            SECRET_MODE,
            force,
        )
        _write(
            public_file,
            _BANNER.format(
                now=now,
                what="public certificate",
                advice="Exchange securely, or use a secure mechanism to verify the contents.",
            )
            + _curve_section(public, None),
            0o644,
            force,
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot write the key pair {name!r} in {directory}: "
            f"{exc.strerror or exc}; check the directory and its permissions"
        ) from exc
    return KeyPair(public_file, secret_file, public.decode("ascii"))


def _curve_section(public: bytes, secret: bytes | None) -> str:
    text = f'metadata\ncurve\n    public-key = "{public.decode("ascii")}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode("ascii")}"\n'
    return text


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    # Created with its final mode (O_EXCL): the secret is never readable by others,
    # not even for the instant a chmod after the write would leave open.
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; pass --force to replace it")
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(partial, mode)  # the umask may have cleared bits of a public file
    os.replace(partial, path)


def read_public_key(source: str | Path) -> str:
    """A Z85 public key given as itself or as a certificate file (``.key`` or ``.key_secret``)."""
    text = str(source)
    if Z85_KEY.match(text) and not Path(text).exists():
        return text
    public, _secret = load_key_file(Path(text))
    return public.decode("ascii")


def load_key_file(path: Path, need_secret: bool = False) -> tuple[bytes, bytes | None]:
    """(public, secret) from a ZeroMQ certificate file; raises ``ConfigError`` saying why.

    With ``need_secret`` the secret key must be present and the file must not be
    readable by others, nor by a group other than the collector's own (like ssh,
    a leaked-looking secret is refused; a Kubernetes secret volume can only be
    group-readable by the pod's ``fsGroup``, which is the collector's group).
    """
    try:
        public, secret = zmq.auth.load_certificate(path)
        info = path.stat()
        mode = info.st_mode
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the CurveZMQ key file {path}: {exc}; create one with "
            "`gradwatch keys generate --name NAME --dir DIR`"
        ) from exc
    if need_secret:
        if secret is None:
            raise ConfigError(
                f"{path} holds no secret key: point at the NAME.key_secret "
                "file, not the public NAME.key"
            )
        own_group = info.st_gid == os.getegid() and not mode & stat.S_IWGRP
        if mode & stat.S_IRWXO or (mode & stat.S_IRWXG and not own_group):
            raise ConfigError(
                f"{path} is readable by other users (mode "
                f"{stat.S_IMODE(mode):o}); run `chmod 600 {path}`"
            )
    if not Z85_KEY.match(public.decode("ascii", "replace")):
        raise ConfigError(f"{path}: the public key is not 40 Z85 characters")
    return public, secret


# ---------------------------------------------------------------- allow-list


def load_allow_list(path: Path) -> AllowList:
    """Parse the allow-list file; raises ``ConfigError`` naming the file and the problem."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f"cannot read the allow-list {path}: {exc.strerror or exc}; create "
            "it with `gradwatch keys allow`"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"the allow-list {path} is not valid YAML: {exc}") from exc
    try:
        return AllowList.model_validate(data or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"the allow-list {path} is invalid: {problems}") from exc


def save_allow_list(path: Path, allow: AllowList) -> None:
    """Write ``allow`` whole, then rename: the collector never reads half a file."""
    clients = [c.model_dump(exclude_defaults=False) for c in allow.clients]
    for client in clients:
        client["jobs"] = list(client["jobs"])
    body = {"version": allow.version, "clients": clients}
    header = "# gradwatch CURVE allow-list: client public key -> job glob patterns.\n"
    _write(path, header + yaml.safe_dump(body, sort_keys=False), 0o644, force=True)


def allow_key(path: Path, public_key: str, jobs: Sequence[str], name: str = "") -> AllowList:
    """Add ``public_key`` (or replace its patterns) in the allow-list at ``path``."""
    current = load_allow_list(path) if path.exists() else AllowList()
    try:
        client = Client(public_key=public_key, jobs=tuple(jobs), name=name)
    except ValidationError as exc:
        raise ConfigError(f"cannot allow this key: {exc.errors()[0]['msg']}") from exc
    others = tuple(c for c in current.clients if c.public_key != public_key)
    updated = AllowList(version=current.version, clients=(*others, client))
    save_allow_list(path, updated)
    return updated


def revoke_key(path: Path, public_key: str) -> bool:
    """Remove ``public_key`` from the allow-list; False when it was not listed."""
    current = load_allow_list(path)
    kept = tuple(c for c in current.clients if c.public_key != public_key)
    if len(kept) == len(current.clients):
        return False
    save_allow_list(path, AllowList(version=current.version, clients=kept))
    return True


# ---------------------------------------------------------------- CLI


def keys_parser(prog: str = "gradwatch keys") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="CurveZMQ keys and the collector's allow-list (see SECURITY.md)."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="write NAME.key and NAME.key_secret (mode 0600)")
    gen.add_argument("--name", required=True, help="file stem, e.g. collector or trainer-a")
    gen.add_argument("--dir", type=Path, default=Path("."), help="directory (default .)")
    gen.add_argument("--force", action="store_true", help="replace existing files")
    allow = sub.add_parser("allow", help="allow a client key to report some jobs")
    allow.add_argument(
        "--public", required=True, help="the client's NAME.key file (or its Z85 public key)"
    )
    allow.add_argument(
        "--jobs", required=True, help="comma-separated job glob patterns, e.g. 'run-*,eval-*'"
    )
    allow.add_argument(
        "--allow-file",
        type=Path,
        required=True,
        help="the allow-list YAML (the collector's curve_allow_file)",
    )
    allow.add_argument("--name", default="", help="a label for logs (default: the file stem)")
    revoke = sub.add_parser("revoke", help="remove a client key from the allow-list")
    revoke.add_argument("--public", required=True, help="NAME.key file or Z85 public key")
    revoke.add_argument("--allow-file", type=Path, required=True)
    return parser


def keys_main(argv: Sequence[str]) -> int:
    """``gradwatch keys generate|allow|revoke``; 0 on success, 1 with a message on error."""
    args = keys_parser().parse_args(list(argv))
    try:
        if args.action == "generate":
            pair = generate_keypair(args.name, args.dir, force=args.force)
            print(
                f"public key {pair.public_key}\n  wrote {pair.public_file} (share it)\n"
                f"  wrote {pair.secret_file} (mode 0600; keep it secret)"
            )
        elif args.action == "allow":
            jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
            public = read_public_key(args.public)
            name = args.name or (Path(args.public).stem if Path(args.public).exists() else "")
            allow_key(args.allow_file, public, jobs, name=name)
            print(
                f"allowed {public} ({name or 'unnamed'}) for jobs {', '.join(jobs)} "
                f"in {args.allow_file}"
            )
        elif not revoke_key(args.allow_file, read_public_key(args.public)):
            print(f"gradwatch keys: that key is not in {args.allow_file}; nothing changed")
            return 1
        else:
            print(f"revoked it in {args.allow_file}; the collector refuses it from now on")
    except ConfigError as exc:
        print(f"gradwatch keys: {exc}", file=sys.stderr)
        return 1
    return 0
