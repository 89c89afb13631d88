"""Who may use the policy server: API keys, and the rule that a server reachable from other
machines has them.

Keys come from `serve.api_keys_file` (one per line; blank lines and `#` comments skipped)
and the `RAYREP_SERVE_API_KEY` environment variable. They stay in the process that reads
them: the replicas get SHA-256 digests only, and a request's bearer token is compared with
every digest in constant time (`hmac.compare_digest`, no early exit), so that neither the
keys nor how much of one a guess matched leave anything behind: not in the run folder, the
config dump, Serve's state or its logs.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path

from rayrep.config import InputError, ServeConfig

KEY_ENV = "RAYREP_SERVE_API_KEY"
"""An API key given through the environment (beside, or instead of, the keys file)."""


def load_api_keys(serve: ServeConfig, environ: dict[str, str] | None = None) -> list[str]:
    """The server's keys: `serve.api_keys_file`'s and `RAYREP_SERVE_API_KEY`'s. A file that
    cannot be read, holds no key, or a line with whitespace inside its key is refused, naming
    the file and the line (never the key)."""
    environ = os.environ if environ is None else environ
    keys = []
    if serve.api_keys_file:
        path = Path(serve.api_keys_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise InputError(f"serve.api_keys_file {path}: cannot be read ({error.__class__.__name__})") from None
        for number, line in enumerate(lines, 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if any(c.isspace() for c in key):
                raise InputError(f"serve.api_keys_file {path}, line {number}: a key has whitespace inside it "
                                 "(one key per line)")
            keys.append(key)
        if not keys:
            raise InputError(f"serve.api_keys_file {path}: no key in the file (one per line)")
    from_env = environ.get(KEY_ENV, "").strip()
    if from_env:
        if any(c.isspace() for c in from_env):
            raise InputError(f"{KEY_ENV}: the key has whitespace inside it")
        keys.append(from_env)
    return keys


def digests(keys: list[str]) -> tuple[bytes, ...]:
    """What a replica holds of the keys."""
    return tuple(hashlib.sha256(key.encode()).digest() for key in keys)


_held: tuple[bytes, ...] = ()
"""The digests this process's server replica asks for (one replica per process)."""


def hold(key_digests: tuple[bytes, ...]) -> None:
    """This process's replica serves with these keys' digests (empty: no key asked)."""
    global _held
    _held = tuple(key_digests)


def held() -> tuple[bytes, ...]:
    return _held


def authorized(header: str | None, key_digests: tuple[bytes, ...]) -> bool:
    """Whether an `Authorization` header carries one of the keys (`Bearer <key>`)."""
    scheme, _, token = (header or "").partition(" ")
    presented = hashlib.sha256(token.strip().encode()).digest()
    match = False
    for digest in key_digests:  # every digest compared, whichever matches
        match |= hmac.compare_digest(presented, digest)
    return match and scheme.lower() == "bearer" and bool(token.strip())


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it may be reachable from elsewhere
        return False


def check_exposure(serve: ServeConfig, keys: list[str]) -> str | None:
    """Refuse to bind a non-loopback address without keys, unless `serve.allow_unauthenticated`;
    returns the warning to print when that override lets it through (None otherwise)."""
    if keys or is_loopback(serve.host):
        return None
    if not serve.allow_unauthenticated:
        raise InputError(f"serve.host={serve.host} makes the server reachable from other machines, and it has no API "
                         f"key: set serve.api_keys_file or {KEY_ENV} (or, knowingly, serve.allow_unauthenticated=true)")
    return (f"warning: serving on {serve.host} without an API key (serve.allow_unauthenticated): anyone who "
            "can reach the port can use the policy")
