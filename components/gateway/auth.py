"""API keys → tenants. Keys are compared by SHA-256 digest; plain keys are never stored."""
from __future__ import annotations

import hashlib
import hmac

from schemas.config import ApiKey


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Authenticator:
    """Who an ``Authorization: Bearer KEY`` header is: ``(tenant, role)``. Roles:
    ``open`` (no keys configured: everyone is ``default``), ``tenant``, and ``operator``
    (an ``api_keys`` entry with ``role = "operator"``: submits as its tenant, and reads
    every tenant's series on /metrics)."""

    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self._keys = {k.sha256: (k.tenant, getattr(k, "role", "tenant")) for k in keys}

    def identify(self, authorization: str | None) -> tuple[str, str] | None:
        """``(tenant, role)`` for an ``Authorization`` header, or None if not accepted."""
        if not self._keys:
            return "default", "open"
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        digest = hash_key(authorization[7:].strip())
        found = None
        for known, who in self._keys.items():
            if hmac.compare_digest(known, digest):
                found = who
        return found

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant for an ``Authorization`` header, or None if it is not accepted.
        With no keys configured, everyone is the ``default`` tenant."""
        who = self.identify(authorization)
        return None if who is None else who[0]

    def metrics_scope(self, authorization: str | None) -> tuple[bool, str | None]:
        """Whether /metrics may be read, and the one tenant whose labelled series the
        caller may see (None: every tenant's). With no keys configured it stays open;
        with keys, no key gets 401, a tenant key its own tenant's series, an operator key
        everything."""
        who = self.identify(authorization)
        if who is None:
            return False, None
        tenant, role = who
        return True, (None if role in ("open", "operator") else tenant)
