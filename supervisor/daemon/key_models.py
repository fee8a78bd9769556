"""The control API's models of key rotation (the route in supervisor/daemon/api.py, the work in
supervisor/profiles/rotation.py)."""
from __future__ import annotations

from pydantic import Field

from sfguard.supervisor.models import Answer


class KeyPending(Answer):
    profile: str
    scope: str
    leased_by: str | None = Field(description="the run that holds it; resealed when that run ends")


class KeyFailed(Answer):
    profile: str
    scope: str
    error: str = Field(description="why it could not be resealed (it stays under its version)")


class KeysRotated(Answer):
    from_version: int = Field(description="the key version that was current before the rotation")
    to_version: int = Field(description="the key version that is current now")
    resumed: bool = Field(description="a rotation a crash (or a refused step) left was resumed")
    resealed: list[str] = Field(description="profiles resealed at rest by this call")
    pending: list[KeyPending] = Field(description="profiles runs hold: resealed when each run ends")
    failed: list[KeyFailed]
    finished: bool = Field(description="no profile is left on an older version (the rotation ended)")
