"""API keys → tenants. Keys are compared by SHA-256 digest; plain keys are never stored."""
from __future__ import annotations

import hashlib
import hmac

from schemas.config import ApiKey


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Authenticator:
    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self._keys = {k.sha256: k.tenant for k in keys}

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant for an ``Authorization`` header, or None if it is not accepted.
        With no keys configured, everyone is the ``default`` tenant."""
        if not self._keys:
            return "default"
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        digest = hash_key(authorization[7:].strip())
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known, digest):
                return tenant
        return None
