"""The Responses API's store in Redis (``--response-store redis://host:port/db``), for replicas on several
machines. Needs the ``redis`` package (extra ``tokenmill[redis]``).

Layout under one prefix (``tokenmill:responses``): a hash per response (owner, encoded body, size), a sorted
set of ids by insertion order, a running byte total and a sequence counter. A put with its evictions, and a
delete, each run as one Lua script, so concurrent writers from any number of servers never see half of one.
"""

from __future__ import annotations

from typing import Any

from tokenmill.server.response_store.local import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_COUNT,
    ResponseStore,
    ResponseStoreError,
)

PREFIX = "tokenmill:responses"

_PUT = """
local p, id, owner, body = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local size, max_count, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local order, total_key = p .. ':order', p .. ':bytes'
local key = p .. ':r:' .. id
local old = redis.call('HGET', key, 'bytes')
if old then
  redis.call('DECRBY', total_key, old)
  redis.call('ZREM', order, id)
  redis.call('DEL', key)
end
local evicted = 0
while true do
  local count = redis.call('ZCARD', order)
  local total = tonumber(redis.call('GET', total_key) or '0')
  if count == 0 or (count < max_count and total + size <= max_bytes) then break end
  local oldest = redis.call('ZRANGE', order, 0, 0)[1]
  local old_key = p .. ':r:' .. oldest
  redis.call('DECRBY', total_key, redis.call('HGET', old_key, 'bytes') or 0)
  redis.call('DEL', old_key)
  redis.call('ZREM', order, oldest)
  evicted = evicted + 1
end
redis.call('HSET', key, 'owner', owner, 'body', body, 'bytes', size)
redis.call('ZADD', order, redis.call('INCR', p .. ':seq'), id)
redis.call('INCRBY', total_key, size)
return evicted
"""

_DELETE = """
local p, id = ARGV[1], ARGV[2]
local key = p .. ':r:' .. id
local size = redis.call('HGET', key, 'bytes')
if not size then return 0 end
redis.call('DECRBY', p .. ':bytes', size)
redis.call('ZREM', p .. ':order', id)
redis.call('DEL', key)
return 1
"""


class RedisResponseStore(ResponseStore):
    kind = "redis"

    def __init__(
        self, url: str, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        super().__init__(max_count, max_bytes)
        try:
            import redis
        except ImportError:
            raise ValueError(
                "--response-store redis://...: install the redis package (tokenmill[redis])"
            ) from None
        self._errors: tuple[type[Exception], ...] = (redis.RedisError,)
        self._redis: Any = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            raise ValueError(f"the response store at {url} cannot be reached: {exc}") from None
        self._put_script = self._redis.register_script(_PUT)
        self._delete_script = self._redis.register_script(_DELETE)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as exc:
            raise ResponseStoreError(f"redis: {exc}") from None

    def _put(self, response_id: str, owner: str, data: bytes) -> int:
        args = [PREFIX, response_id, owner, data, len(data), self.max_count, self.max_bytes]
        return int(self._call(lambda: self._put_script(args=args)))

    def _get(self, response_id: str) -> tuple[str, bytes] | None:
        owner, body = self._call(self._redis.hmget, f"{PREFIX}:r:{response_id}", ["owner", "body"])
        return None if body is None else (owner.decode(), bytes(body))

    def _delete(self, response_id: str) -> bool:
        return bool(self._call(lambda: self._delete_script(args=[PREFIX, response_id])))

    def __len__(self) -> int:
        return int(self._call(self._redis.zcard, f"{PREFIX}:order"))

    @property
    def num_bytes(self) -> int:
        return int(self._call(self._redis.get, f"{PREFIX}:bytes") or 0)

    def close(self) -> None:
        self._redis.close()
