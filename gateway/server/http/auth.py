"""Who is calling: the Bearer key names a team."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import replace

from aiohttp import web

from gateway.config.settings import TeamConfig
from gateway.server.http.errors import Unauthorized


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Keys -> teams. Lookups go by sha256 digest and compare in constant time, so the
    time a wrong key takes says nothing about the right ones."""

    def __init__(self, teams: Iterable[TeamConfig]) -> None:
        self._by_digest: dict[bytes, TeamConfig] = {}
        self._digests: dict[str, tuple[bytes, ...]] = {}
        self.configure(teams)

    def configure(self, teams: Iterable[TeamConfig]) -> None:
        """Serve these teams' keys from now on (at start, and on a config reload: the one place
        the config's keys become the keys that authenticate). Both maps are swapped whole."""
        teams = list(teams)
        by_digest = {_digest(k): t for t in teams for k in t.keys}
        for t in teams:  # a key with limits of its own authenticates as its team carrying them
            for limits in t.key_limits:
                by_digest[_digest(limits.key)] = replace(t, caller=limits)
        digests = {t.name: tuple(_digest(k) for k in t.keys) for t in teams}
        self._by_digest, self._digests = by_digest, digests

    def team(self, key: str) -> TeamConfig | None:
        digest = _digest(key)
        team = self._by_digest.get(digest)
        if team is None:
            return None
        # The dict found it by hash; confirm in constant time against the stored digest.
        return team if any(hmac.compare_digest(digest, d) for d in self._digests[team.name]) else None

    def authenticate(self, request: web.Request) -> TeamConfig:
        """The caller's team, or 401 naming what is wrong with the header."""
        header = request.headers.get("Authorization")
        if not header:
            raise Unauthorized("missing Authorization header: send 'Authorization: Bearer <your gateway key>'")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        team = self.team(key.strip())
        if team is None:
            raise Unauthorized("invalid API key: no team has this key")
        return team
