"""API keys to tenants: ``Authorization: Bearer <key>`` → the tenant that owns the key.

Keys are configured as SHA-256 hex digests only (inline in ``tenants.list[].key_sha256``, or in
``tenants.keys_file``: one ``<tenant> <digest>`` per line, ``#`` comments), so the config never holds
a key in clear.  A presented key is hashed and compared with every configured digest with
:func:`hmac.compare_digest`, no early exit: the time taken does not depend on how much of a digest
matched, nor on which tenant's key it was.  The file is re-read when its modification time or size
changes (checked at most every ``keys_reload_s``); a file that cannot be read or parsed keeps the
keys loaded before, and says why in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from narwhal_serve.config import TenantsConfig

log = logging.getLogger(__name__)

ANONYMOUS = ""  # the tenant of a router with no tenants section


def digest_of(key: str) -> bytes:
    """A configured key's digest (the SHA-256 of its UTF-8 text)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def sent_digest(key: str) -> bytes:
    """The digest of a key as the client sent it: the HTTP server decodes header bytes as Latin-1,
    so encoding back gives the bytes sent (UTF-8 re-encoding hashed other bytes: a key with any byte
    past 0x7f never matched ``printf %s "$KEY" | sha256sum``)."""
    try:
        return hashlib.sha256(key.encode("latin-1")).digest()
    except UnicodeEncodeError:  # (not from a header's bytes)
        return digest_of(key)


def parse_keys_file(text: str, known: frozenset[str], bound: dict[bytes, str] | None = None
                    ) -> tuple[list[tuple[bytes, str]], list[str]]:
    """(digest, tenant) pairs from a keys file, and a problem per line that was skipped.
    ``bound``: the digests the config gives their tenants; a line that would give one of those (or
    one of an earlier line's) to another tenant is skipped — the last match won: the key silently
    another tenant's, as the config refuses it."""
    out: list[tuple[bytes, str]] = []
    problems: list[str] = []
    owner = dict(bound or {})
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            problems.append(f"line {n}: expected `<tenant> <sha256 hex digest>`")
            continue
        tenant, hexd = parts
        hexd = hexd.removeprefix("sha256:").lower()
        if tenant not in known:
            problems.append(f"line {n}: unknown tenant {tenant!r} (not in tenants.list)")
            continue
        try:
            d = bytes.fromhex(hexd)
        except ValueError:
            d = b""
        if len(d) != 32:
            problems.append(f"line {n}: not a SHA-256 hex digest")
            continue
        if owner.setdefault(d, tenant) != tenant:
            problems.append(f"line {n}: this key is tenant {owner[d]!r}'s already")
            continue
        out.append((d, tenant))
    return out, problems


@dataclass
class KeyRing:
    """Digest → tenant, from the config and the keys file."""

    cfg: TenantsConfig | None
    flat: tuple[str, ...] = ()  # serving.api_keys: the keys of before, one anonymous tenant
    mono: Callable[[], float] = field(default=lambda: 0.0)
    _inline: list[tuple[bytes, str]] = field(default_factory=list)
    _from_file: list[tuple[bytes, str]] = field(default_factory=list)
    _file_sig: tuple[float, int] | None = None
    _checked: float = float("-inf")
    reloads: int = 0  # times the keys file was (re)loaded

    def __post_init__(self) -> None:
        if self.cfg is not None:
            self._inline = [(bytes.fromhex(d), t.name) for t in self.cfg.list for d in t.key_sha256]
        self._inline += [(digest_of(k), ANONYMOUS) for k in self.flat]
        self.maybe_reload(force=True)

    @property
    def required(self) -> bool:
        """Whether a request must present a key."""
        return self.cfg is not None or bool(self.flat)

    def maybe_reload(self, *, force: bool = False) -> None:
        if self.cfg is None or self.cfg.keys_file is None:
            return
        now = self.mono()
        if not force and now - self._checked < self.cfg.keys_reload_s:
            return
        self._checked = now
        path = self.cfg.keys_file
        try:
            st = os.stat(path)
            sig = (st.st_mtime, st.st_size)
            if sig == self._file_sig:
                return
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, ValueError) as exc:  # (ValueError: not UTF-8)
            if self._file_sig is not None or force:
                log.error("tenants.keys_file %s cannot be read (%s): keeping the keys loaded before", path, exc)
            self._file_sig = None
            return
        pairs, problems = parse_keys_file(text, frozenset(t.name for t in self.cfg.list), dict(self._inline))
        for p in problems:
            log.warning("tenants.keys_file %s: %s (skipped)", path, p)
        self._from_file = pairs
        self._file_sig = sig
        self.reloads += 1
        log.info("tenants.keys_file %s: %d keys loaded", path, len(pairs))

    def identify(self, authorization: str | None) -> str | None:
        """The tenant of the request's bearer key; None when this key is unknown, or missing where
        a key is required.  Without keys configured, every request is the anonymous tenant; with
        ``tenants.anonymous``, a request without a key is that tenant."""
        if not self.required:
            return ANONYMOUS
        given = (authorization or "").strip()
        scheme, _, key = given.partition(" ")
        key = key.strip()
        if not given or (scheme.lower() == "bearer" and not key):  # no key (a blank one is none)
            return self.cfg.anonymous if self.cfg is not None else None
        if scheme.lower() != "bearer":
            return None
        self.maybe_reload()
        d = sent_digest(key)
        found: str | None = None
        for known, tenant in (*self._inline, *self._from_file):
            if hmac.compare_digest(d, known):  # every digest compared: no early exit
                found = tenant
        return found
