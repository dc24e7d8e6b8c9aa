"""The response cache, identical on every rank.

Every rank adds cacheable responses in batch order, so ids agree everywhere without extra
messages. A rank that resubmits a request matching a cached response sends only its id. Ids
are never reused; when a key gets a new response (an allgather whose sizes changed), the old
id stops matching new requests but can still be decoded by the coordinator, so a request
that raced with the replacement is understood. When the cache is full, new responses are
simply not cached (no eviction: nothing to keep in sync); replacements stop after
``4 * capacity`` ids so keys whose sizes change every step cannot grow it without bound.
"""
from __future__ import annotations

from typing import Sequence

from .messages import Coll, Request, Response, signature

_CACHEABLE = (Coll.ALLREDUCE, Coll.ALLGATHER, Coll.BROADCAST, Coll.ALLTOALL, Coll.REDUCESCATTER)


class ResponseCache:
    """id -> Response, and this rank's request -> id for quick lookups."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._entries: list[Response] = []
        self._by_key: dict[tuple, int] = {}
        self._by_request: dict[Request, int] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    @staticmethod
    def cacheable(resp: Response) -> bool:
        return not resp.error and resp.request.coll in _CACHEABLE

    def add(self, resp: Response, my_index: int | None) -> int:
        """Insert ``resp`` (if cacheable and there is room); returns its id or -1.

        ``my_index`` is this rank's index in the response's process set (None when this rank
        is not a member), used to index the request this rank would send for it.
        """
        if not self.cacheable(resp):
            return -1
        key = resp.request.key
        old = self._by_key.get(key)
        if old is None and len(self._by_key) >= self.capacity:
            return -1
        if len(self._entries) >= 4 * self.capacity:  # bound memory when keys keep changing
            return -1
        new_id = len(self._entries)
        self._entries.append(resp)
        self._by_key[key] = new_id
        if old is not None:
            stale = [req for req, i in self._by_request.items() if i == old]
            for req in stale:
                del self._by_request[req]
        if my_index is not None:
            self._by_request[resp.request_of(my_index)] = new_id
        return new_id

    def id_of(self, key: tuple) -> int:
        """The current id of a key ``(collective type, process set, name)``, or -1."""
        return self._by_key.get(key, -1)

    def lookup(self, req: Request) -> int:
        """The id of a cached response this exact request matches, or -1."""
        return self._by_request.get(req, -1)

    def get(self, cache_id: int) -> Response:
        return self._entries[cache_id]

    def has(self, cache_id: int) -> bool:
        return 0 <= cache_id < len(self._entries)

    def ids(self) -> Sequence[int]:
        return list(self._by_key.values())


class SignatureCache:
    """id -> Response for ordered requests, looked up by signature (request minus its label).

    Filled in batch order on every rank, like :class:`ResponseCache`, so ids agree everywhere.
    A signature seen again with other per-rank data (an allgather whose first dimensions
    changed on another rank) gets a new id; the table stops growing at ``4 * capacity`` ids.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._entries: list[Response] = []
        self._by_sig: dict[Request, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, resp: Response, my_index: int | None) -> int:
        """Insert ``resp`` (if cacheable and there is room); returns its id or -1."""
        if not ResponseCache.cacheable(resp) or len(self._entries) >= 4 * self.capacity:
            return -1
        new_id = len(self._entries)
        self._entries.append(resp)
        if my_index is not None:
            self._by_sig[signature(resp.request_of(my_index))] = new_id
        return new_id

    def lookup(self, sig: Request) -> int:
        """The id of a cached response matching this rank's signature ``sig``, or -1."""
        return self._by_sig.get(sig, -1)

    def get(self, cache_id: int) -> Response:
        return self._entries[cache_id]
