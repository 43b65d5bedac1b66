"""API keys to tenants: hashed keys inline and in a file re-read on change, constant-time
comparison of every digest, 401 for missing or unknown keys, the anonymous tenant without keys."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from narwhal_serve.config import NarwhalConfig, TenantsConfig
from narwhal_serve.tenants.keys import ANONYMOUS, KeyRing


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenants(keys_file: str | None = None, **more: object) -> TenantsConfig:
    return TenantsConfig.model_validate({
        "list": [{"name": "acme", "key_sha256": [sha("k-acme")]}, {"name": "beta", "key_sha256": [sha("k-beta"), sha("k-beta2")]}],
        "keys_file": keys_file, **more})


class Mono:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_inline_keys_map_to_their_tenants_and_anything_else_is_refused() -> None:
    ring = KeyRing(tenants())
    assert ring.identify("Bearer k-acme") == "acme"
    assert ring.identify("bearer k-beta2") == "beta"  # the scheme is case-insensitive
    for bad in (None, "", "Bearer", "Bearer ", "Bearer k-acm", "Basic k-acme", "k-acme", "Bearer k-acme2"):
        assert ring.identify(bad) is None, bad


def test_without_tenants_every_request_is_the_anonymous_tenant_and_flat_keys_still_work() -> None:
    assert KeyRing(None).identify(None) == ANONYMOUS
    flat = KeyRing(None, ("secret",))
    assert flat.identify("Bearer secret") == ANONYMOUS
    assert flat.identify("Bearer other") is None and flat.identify(None) is None


def test_the_keys_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"# tenant digest\nacme {sha('file-key-1')}\n")
    mono = Mono()
    ring = KeyRing(tenants(str(path), keys_reload_s=1.0), mono=mono)
    assert ring.identify("Bearer file-key-1") == "acme"
    path.write_text(f"beta sha256:{sha('file-key-2')}  # rotated\n")
    os.utime(path, (1, 1))  # a different modification time, whatever the file system's resolution
    mono.t = 0.5
    assert ring.identify("Bearer file-key-2") is None  # not checked again within keys_reload_s
    mono.t = 1.6
    assert ring.identify("Bearer file-key-2") == "beta"
    assert ring.identify("Bearer file-key-1") is None  # removed from the file: refused
    assert ring.identify("Bearer k-acme") == "acme"  # inline keys stay
    assert ring.reloads == 2


def test_a_broken_keys_file_keeps_the_keys_before_and_bad_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"acme {sha('good')}\nnobody {sha('x')}\nacme nothex\nacme\n")
    mono = Mono()
    ring = KeyRing(tenants(str(path)), mono=mono)
    assert ring.identify("Bearer good") == "acme"
    assert ring.identify("Bearer x") is None  # a tenant not in tenants.list
    path.unlink()
    mono.t = 5.0
    assert ring.identify("Bearer good") == "acme"


def test_config_rejects_clear_keys_and_two_key_sources() -> None:
    with pytest.raises(ValidationError, match="SHA-256"):
        TenantsConfig.model_validate({"list": [{"name": "a", "key_sha256": ["k-acme"]}]})
    with pytest.raises(ValidationError, match="exclusive"):
        NarwhalConfig.model_validate({"serving": {"api_keys": ["k"]}, "tenants": {"list": [{"name": "a"}]}})
    with pytest.raises(ValidationError, match="unique"):
        TenantsConfig.model_validate({"list": [{"name": "a"}, {"name": "a"}]})


def test_an_anonymous_tenant_takes_requests_without_a_key_but_not_unknown_keys() -> None:
    ring = KeyRing(tenants(anonymous="beta"))
    assert ring.identify(None) == "beta" and ring.identify("") == "beta"
    assert ring.identify("Bearer k-acme") == "acme"
    assert ring.identify("Bearer not-a-key") is None
    with pytest.raises(ValidationError, match="anonymous"):
        tenants(anonymous="nobody")


def test_a_keys_file_that_is_not_utf8_keeps_the_keys_before(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"acme {sha('good')}\n")
    mono = Mono()
    ring = KeyRing(tenants(str(path)), mono=mono)
    path.write_bytes(f"# caf\xe9\nacme {sha('other')}\n".encode("latin-1"))
    os.utime(path, (1, 1))
    mono.t = 5.0
    assert ring.identify("Bearer good") == "acme" and ring.identify("Bearer other") is None
    assert KeyRing(tenants(str(path))).identify("Bearer k-acme") == "acme"  # and a replica still starts
