"""API keys: who may call the server, and which prefix-cache partition each caller's requests share.

A server takes any number of keys (``--api-key`` repeated, ``--api-key-file``). Each key is its own prefix-cache
partition, so a caller's ``cached_tokens`` (and its latency) only ever reflects its own earlier prompts; a key file
may name a tenant after a key, and the keys of one tenant share its partition. Without keys every request is allowed
and the bearer token a client presents (none: "") still picks its partition.

Key file: one key per line, optionally followed by whitespace and a tenant name; blank lines and lines starting with
``#`` are ignored.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from server.api.errors import APIError


@dataclass(frozen=True)
class ApiKeys:
    partitions: dict[str, str]  # key -> its prefix-cache partition

    @classmethod
    def of(cls, keys: list[str] | None = None, file: str | Path | None = None) -> "ApiKeys | None":
        """The keys given, plus a key file's; None when there are none (authentication off)."""
        pairs = [(k, None) for k in keys or ()]
        if file is not None:
            given = len(pairs)
            for n, line in enumerate(Path(file).read_text(encoding="utf-8").splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                fields = line.split()
                if len(fields) > 2:
                    raise ValueError(f"{file}:{n}: a line holds a key and at most a tenant name, separated by spaces")
                pairs.append((fields[0], fields[1] if len(fields) == 2 else None))
            if len(pairs) == given:
                raise ValueError(f"{file} holds no key (a server given a key file would otherwise run without keys)")
        partitions = {}
        for key, tenant in pairs:
            if not key:
                raise ValueError("an API key must not be empty")
            if not key.isascii() or not key.isprintable() or key != key.strip():
                raise ValueError("an API key must be printable ASCII without spaces around it (it travels in an HTTP "
                                 "header)")
            partition = partition_of(key) if tenant is None else f"tenant\0{tenant}"
            if partitions.setdefault(key, partition) != partition:
                raise ValueError("a key is listed twice with different tenants")
        return cls(partitions) if partitions else None

    def check(self, request: Request) -> str:
        """The caller's partition; a 401 unless it presented one of the keys. Every key is compared, in constant time
        each, so the time taken does not tell which key came close."""
        token = bearer_token(request).encode("latin-1")
        found = None
        for key, partition in self.partitions.items():
            if hmac.compare_digest(token, key.encode("ascii")) and token:
                found = partition
        if found is None:
            raise APIError(401, "Missing or incorrect API key: send it as `Authorization: Bearer <key>`.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return found


def bearer_token(request: Request) -> str:
    """The key the client presented as `Authorization: Bearer <key>`, or "" when it sent none. Starlette decodes
    header bytes as latin-1, so `.encode("latin-1")` recovers the bytes the client sent."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def partition_of(token: str) -> str:
    """The partition of a key that names no tenant (and, without keys configured, of any presented token): the key
    itself (hashed before it leaves the API process: ``server.api.generation.cache_namespace``). A tenant's is
    "tenant" NUL name, which no key can be (a key is printable; a header cannot hold a NUL)."""
    return token


def caller_partition(keys: ApiKeys | None, request: Request) -> str:
    """Authenticate the request (with keys configured) and return the prefix-cache partition it uses."""
    return partition_of(bearer_token(request)) if keys is None else keys.check(request)
