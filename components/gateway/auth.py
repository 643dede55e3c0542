"""API keys → tenants. Keys are compared by SHA-256 digest; plain keys are never stored."""
from __future__ import annotations

from bus.identity import digest as hash_key, find_key  # noqa: F401 - re-exported for `weir hash-key`
from schemas.config import ApiKey


class Authenticator:
    """Who an ``Authorization: Bearer KEY`` header is: ``(tenant, role)``. Roles:
    ``open`` (no keys configured: everyone is ``default``), ``tenant``, and ``operator``
    (an ``api_keys`` entry with ``role = "operator"``: submits as its tenant, and reads
    every tenant's series on /metrics)."""

    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self._keys = {k.sha256: k for k in keys}

    def identify(self, authorization: str | None) -> tuple[str, str] | None:
        """``(tenant, role)`` for an ``Authorization`` header, or None if not accepted."""
        if not self._keys:
            return "default", "open"
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        key = find_key(self._keys, authorization[7:].strip())
        return None if key is None else (key.tenant, getattr(key, "role", "tenant"))

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
