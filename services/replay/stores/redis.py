"""RedisStore: the replay store on Redis, so replay data outlives the replay service process.

Same semantics as MemoryStore (on-policy FIFO with a version bound, capacity-bounded window sampled uniformly over
transitions), kept in Redis under ``<replay.key_prefix>:<run_id>:``:

  batch:<id>   string the batch as the data plane's frames [store header, codec header, buf0, buf1, ...] (JSON
                      headers and raw buffers, no pickle), length-prefixed: b"RLF1", u32 count, u64 length each,
                      then the frames. A tensor larger than replay.offload_bytes goes to the object store under
                      ``replay/<run_id>/<id>/<tensor>``: its frame is empty and the store header records the key.
  window       list   one entry per batch, oldest first: "id transitions version nbytes offloaded" (offloaded: 1
                      if it has tensors in the object store). What ``sample`` draws from and what capacity evicts; the
                      newest ``pending`` entries are the batches not yet taken on-policy (oldest first)
  refs         hash   id -> JSON list of object keys, for batches with offloaded tensors (deleted on eviction).
                      Only keys of that batch under the run's own object prefix are ever read or deleted:
                      whoever can write Redis could otherwise name a checkpoint (an error log and
                      rlfabric_replay_foreign_refs_total count each one ignored)
  stats        hash   transitions, bytes, puts, onpolicy_gets, samples, evicted, stale_dropped, newest_version, pending
  take         hash   the last take's token and id, so a retried take returns the same batch

(Keeping each batch's numbers in its window entry and the pending batches as a count makes a put's script a handful
of O(1) commands.)

One string per batch, because a large SET is zero-copy in Redis (a list or hash copies every element into its
packed encoding: ~0.3 ms per 3 MiB batch measured here).

Every mutation is one atomic round trip (MULTI/EXEC or a Lua script) and is idempotent, so a retry after a lost
reply neither duplicates nor drops a batch. Puts and takes go out on the store's own connection, written and parsed
here (_Wire): a small put is one write, one read and a few microseconds of Lua. One replay service owns a run's keys
at a time: it mirrors the window (ids and counts) and caches what it stored, so sampling needs no Redis round trip
when the window fits in ``cache_bytes``. A restarted replay service opens the same keys and carries on.

Connection loss: each operation is retried ``replay.retry_attempts`` times with exponential backoff from
``replay.retry_backoff_s`` (redis-py's Retry/ExponentialBackoff), then fails with ReplayStoreUnavailable, whose
message names the config fields and the fix.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import re
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from prometheus_client import Counter
from redis._parsers.base import BaseParser
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.core.codec import FrameError, decode, encode, frame_parts, unpack_frames
from rlfabric.services.replay.stores import (
    WindowMax,
    check_batch,
    draw_rows,
    gather_rows,
    row_bytes,
    sample_windows,
)

log = logging.getLogger(__name__)
R = TypeVar("R")
FOREIGN_REFS = Counter("rlfabric_replay_foreign_refs_total",
                       "object keys named in Redis replay state that are not the named batch's own offloaded tensors "
                       "(ignored: never read or deleted)")
_BATCH_ID = re.compile(r"[0-9]{10,20}-[0-9a-f]{8}")  # what put() names a batch
_KEY_PART = re.compile(r"[A-Za-z0-9_.=~-]{1,160}")  # what _object_key() names a tensor (_safe_key_part, ~index)

STORE_FORMAT = 1
_FIELDS = ("transitions", "bytes", "puts", "onpolicy_gets", "samples", "evicted", "stale_dropped", "newest_version")
_DECODE_BOUND = 1 << 40  # frames were validated when put; this only guards against a corrupted value
INLINE_BYTES = 1 << 10  # values up to this size go to Redis inside the script call, larger ones SET in a MULTI (Lua
#                         takes an argument at ~1 us per KiB; the MULTI costs ~1 us and three more replies)
_BIG_PIECE = 64 << 10  # a request's pieces up to this size are joined and sent at once; larger ones sent as they are
_MULTI, _EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"
# what MULTI, SET, EVALSHA, EXEC answer before the script's own reply (+OK, QUEUED, QUEUED, then EXEC's array of
# the SET's OK and the script's reply), and those replies as parsed
_PUT_EXEC = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n"
_EXPECTED = {_PUT_EXEC: lambda reply: [b"OK", b"QUEUED", b"QUEUED", [b"OK", reply]]}


class ReplayStoreError(RuntimeError):
    """The replay store cannot do what was asked; the message names the cause and the fix. ``bad_input`` marks
    causes in the run config (a malformed URL, wrong credentials, a key prefix another program uses)."""

    def __init__(self, message: str, bad_input: bool = False):
        super().__init__(message)
        self.bad_input = bad_input


class ReplayStoreUnavailable(ReplayStoreError):
    """Redis could not be reached (at open, or mid-run after the bounded retries)."""


# KEYS of every script: window, stats, take, refs. Scripts report the state as one line, "window_len pending_len c1 ... c8": the window's length, the pending
# count and the counters in _FIELDS order (0, or -1 for newest_version, where never set), for the caller's mirror
# (one bulk string: far cheaper to parse than nested arrays). Costs measured on Redis 7.0, which shaped these scripts:
# a redis.call() about 0.5 us, a new field in a hash of a few hundred (a listpack, scanned) a few us, an argument
# passed into Lua about 1 us per KiB, and a MULTI around a plain SET and the script about 1 us.
_PROLOGUE = """
local W, S, TK, R = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local FIELDS = {'transitions', 'bytes', 'puts', 'onpolicy_gets', 'samples', 'evicted', 'stale_dropped',
                'newest_version', 'pending'}
local function line(c, wl, pl)
  return table.concat({wl, pl, c[1] or 0, c[2] or 0, c[3] or 0, c[4] or 0, c[5] or 0, c[6] or 0, c[7] or 0,
                       c[8] or -1}, ' ')
end
"""

# ARGV: capacity, batch key prefix, id ('' = only trim), transitions, version, nbytes, refs JSON ('' = none), samples
# to add, the puts count once this put is in, then the value if it comes inline (tiny batches: one command). A
# larger value is SET by the same MULTI just before (zero-copy; through Lua it would cost ~1 us/KiB). A retried put
# whose first attempt landed (the puts count is already there and the entry is in the window) changes nothing.
# Evicts the oldest batches while the window holds more than the capacity. The counters are read once and written
# back once (one HMGET, one HSET) rather than incremented field by field. Returns the status line, then for each
# evicted batch its id and refs JSON (empty unless it has offloaded tensors, which the caller deletes), all joined
# by newlines (ids and JSON hold none).
_PUT_LUA = _PROLOGUE + """
local cap, prefix, id = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local c = redis.call('HMGET', S, unpack(FIELDS))
local t, nb, puts, pl = tonumber(c[1]) or 0, tonumber(c[2]) or 0, tonumber(c[3]) or 0, tonumber(c[9]) or 0
local wl, dirty = nil, false
if id ~= '' then
  local entry = id .. ' ' .. ARGV[4] .. ' ' .. ARGV[5] .. ' ' .. ARGV[6] .. ' ' .. (ARGV[7] == '' and '0' or '1')
  -- (the usual case needs no search: the count is the one before this put)
  if puts + 1 == tonumber(ARGV[9]) or not redis.call('LPOS', W, entry, 'RANK', -1) then
    if #ARGV > 9 then redis.call('SET', prefix .. id, ARGV[10]) end
    if ARGV[7] ~= '' then redis.call('HSET', R, id, ARGV[7]) end
    wl = redis.call('RPUSH', W, entry)
    t, nb, puts, pl = t + tonumber(ARGV[4]), nb + tonumber(ARGV[6]), puts + 1, pl + 1
    c[3] = string.format('%d', puts)  -- (numbers made strings once: HSET and the status line both take them)
    if ARGV[8] ~= '0' then c[5] = string.format('%d', (tonumber(c[5]) or 0) + tonumber(ARGV[8])) end
    if not c[8] or tonumber(ARGV[5]) > tonumber(c[8]) then c[8] = ARGV[5] end
    dirty = true
  end
end
wl = wl or redis.call('LLEN', W)
if pl > wl then pl = wl end
local out, keys = {''}, {}
while t > cap do
  local old = redis.call('LPOP', W)
  if not old then break end
  if pl >= wl then pl = wl - 1 end  -- pending is the newest pl entries: the oldest was pending only if all were
  wl = wl - 1
  local oid, n, b, o = string.match(old, '^(%S+) (%d+) %S+ (%d+) (%d)$')
  if oid then
    t, nb = t - tonumber(n), nb - tonumber(b)
    local refs = ''
    if o ~= '0' then
      refs = redis.call('HGET', R, oid) or ''
      redis.call('HDEL', R, oid)
    end
    keys[#keys + 1] = prefix .. oid
    out[#out + 1] = oid
    out[#out + 1] = refs
  end
  dirty = true
end
if #keys > 0 then
  c[6] = string.format('%d', (tonumber(c[6]) or 0) + #keys)
  for i = 1, #keys, 1000 do  -- (unpack takes a few thousand values at most)
    redis.call('DEL', unpack(keys, i, math.min(i + 999, #keys)))
  end
end
if dirty then
  c[1], c[2], pl = string.format('%d', t), string.format('%d', nb), string.format('%d', pl)
  redis.call('HSET', S, 'transitions', c[1], 'bytes', c[2], 'puts', c[3] or '0', 'samples', c[5] or '0',
             'evicted', c[6] or '0', 'newest_version', c[8] or '-1', 'pending', pl)
end
out[1] = line(c, wl, pl)
return table.concat(out, '\\n')
"""

# ARGV: min_version, token, samples to add, '1' to get the batch's value too, batch key prefix. Walks the pending
# entries (the newest ``pending`` of the window) oldest first, dropping (and counting) stale ones until one is new
# enough; returns [id or '', status line, value or false]. Returning the value in the same call means a batch is
# never taken without being read (a later read could fail).
_TAKE_LUA = _PROLOGUE + """
local function value_of(id)
  if id ~= '' and ARGV[4] == '1' then return redis.call('GET', ARGV[5] .. id) end
  return false
end
local c = redis.call('HMGET', S, unpack(FIELDS))
local wl = redis.call('LLEN', W)
local pl = math.min(tonumber(c[9]) or 0, wl)
local last = redis.call('HMGET', TK, 'token', 'id')
if last[1] == ARGV[2] then
  local id = last[2] or ''
  return {id, line(c, wl, pl), value_of(id)}
end
local minv = tonumber(ARGV[1])
local found, stale, size = '', 0, 1
while found == '' and pl > 0 do
  size = math.min(size, pl)  -- read 1, 2, 4, ... 256 entries at a time: usually the first is taken
  for _, e in ipairs(redis.call('LRANGE', W, -pl, size - pl - 1)) do
    pl = pl - 1
    local id, v = string.match(e, '^(%S+) %S+ (%S+)')
    if id and tonumber(v) >= minv then
      found = id
      break
    end
    stale = stale + 1
  end
  size = math.min(2 * size, 256)
end
local kv = {'pending', pl}
if found ~= '' then
  c[4] = (tonumber(c[4]) or 0) + 1
  kv[3], kv[4] = 'onpolicy_gets', c[4]
end
if stale > 0 then
  c[7] = (tonumber(c[7]) or 0) + stale
  kv[#kv + 1], kv[#kv + 2] = 'stale_dropped', c[7]
end
if ARGV[3] ~= '0' then
  c[5] = (tonumber(c[5]) or 0) + tonumber(ARGV[3])
  kv[#kv + 1], kv[#kv + 2] = 'samples', c[5]
end
redis.call('HSET', S, unpack(kv))
redis.call('HSET', TK, 'token', ARGV[2], 'id', found)
return {found, line(c, wl, pl), value_of(found)}
"""

# ARGV: batch key prefix. Drops every batch, keeps the counters; [{id, refs JSON, ...}, status line].
_CLEAR_LUA = _PROLOGUE + """
for _, e in ipairs(redis.call('LRANGE', W, 0, -1)) do
  redis.call('DEL', ARGV[1] .. string.match(e, '^%S+'))
end
local refs = redis.call('HGETALL', R)
redis.call('DEL', W, R)
redis.call('HSET', S, 'transitions', 0, 'bytes', 0, 'pending', 0)
return {refs, line(redis.call('HMGET', S, unpack(FIELDS)), 0, 0)}
"""

def _bulk(arg: Any) -> bytes:
    """One RESP bulk string."""
    data = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _coalesce(pieces: list[Any], big: int = _BIG_PIECE) -> list[Any]:
    """The pieces joined into as few buffers as possible, copying only small ones: one sendall per buffer, and a
    request in one buffer reaches Redis in one read."""
    sizes = [piece.nbytes if type(piece) is memoryview else len(piece) for piece in pieces]
    if sum(sizes) <= big:
        return [b"".join(pieces)]
    out: list[Any] = []
    small: list[Any] = []
    for piece, size in zip(pieces, sizes, strict=True):
        if size > big:
            if small:
                out.append(b"".join(small))
                small = []
            out.append(piece)
        else:
            small.append(piece)
    if small:
        out.append(b"".join(small))
    return out


def _batch_frames(batch: TensorBatch) -> tuple[list[Any], int]:
    """The batch's codec frames (the data plane's wire format, declared dims and ragged fields included) and the
    bytes of its buffers."""
    frames = encode("batch", batch)
    return frames, sum(memoryview(f).nbytes for f in frames[1:])


class _Wire:
    """The store's own connection for puts and takes: each request written whole, its replies parsed here.

    redis-py connects it (TLS, AUTH, SELECT: whatever the URL asks) and stays the owner of the socket; this only
    writes and reads it between handshakes, and redis-py's own reader never sees it in between. Bypassing the pool
    checkout (which polls the socket), command packing (a large argument goes out in three sends) and the reply
    parser (pure Python, four replies for a MULTI) saves most of the client time of a small put.

    Errors are redis-py's: a lost or confused connection is disconnected (the next request reconnects) and raised as
    ConnectionError/TimeoutError; error replies come back as exception objects (redis-py's classes, e.g.
    NoScriptError), for the caller to raise once every reply was read, so the connection stays in step."""

    BIG = 1 << 16  # a bulk reply larger than this is received straight into its own buffer

    def __init__(self, client: redis.Redis):
        self._client = client
        self._conn: Any = None
        self._sock: Any = None
        self._buf = b""
        self._pos = 0

    def request(self, pieces: list[Any], replies: int, expect: bytes = b"") -> list[Any]:
        """Send the pieces (one or more pipelined commands) and read ``replies`` replies. ``expect``: what the
        replies but the last usually are, byte for byte (then they are skipped rather than parsed; the result
        is the same)."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self._client.connection_pool.get_connection()
        if conn._sock is None:
            conn.connect()
        self._sock = sock = conn._sock
        self._buf, self._pos = b"", 0
        try:
            for buf in _coalesce(pieces) if len(pieces) > 1 else pieces:
                sock.sendall(buf)
            if expect:
                self._fill()
                if self._buf.startswith(expect):
                    self._pos = len(expect)
                    return _EXPECTED[expect](self._reply())
            return [self._reply() for _ in range(replies)]
        except TimeoutError:  # (socket.timeout)
            self.disconnect()
            raise redis.TimeoutError("Timeout talking to Redis") from None
        except OSError as exc:
            self.disconnect()
            raise redis.ConnectionError(f"Error talking to Redis: {exc}") from None
        except BaseException:
            self.disconnect()
            raise

    def disconnect(self) -> None:
        self._buf, self._pos, self._sock = b"", 0, None
        if self._conn is not None:
            self._conn.disconnect()

    def release(self) -> None:
        if self._conn is not None:
            self._client.connection_pool.release(self._conn)
            self._conn = None

    def _fill(self) -> None:
        chunk = self._sock.recv(self.BIG)
        if not chunk:
            raise redis.ConnectionError("Connection closed by server.")
        self._buf = self._buf[self._pos:] + chunk if self._pos < len(self._buf) else chunk
        self._pos = 0

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n", self._pos)) < 0:
            self._fill()
        line = self._buf[self._pos:end]
        self._pos = end + 2
        return line

    def _reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$" or kind == b"=":  # bulk string (RESP3: verbatim string)
            return None if rest == b"-1" else self._bulk(int(rest))
        if kind == b"+":
            return rest
        if kind == b"*" or kind == b"~" or kind == b">":  # array (RESP3: set, push)
            return None if rest == b"-1" else [self._reply() for _ in range(int(rest))]
        if kind == b"-":
            return BaseParser.parse_error(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"_":  # RESP3 null
            return None
        raise redis.ConnectionError(f"Protocol error: unexpected reply {line[:40]!r} from Redis")

    def _bulk(self, n: int) -> Any:
        end = self._pos + n
        if end + 2 <= len(self._buf):
            data = self._buf[self._pos:end]
            self._pos = end + 2
            return data
        if n <= self.BIG:
            while end + 2 > len(self._buf):
                self._fill()
                end = self._pos + n
            data = self._buf[self._pos:end]
            self._pos = end + 2
            return data
        # a large value: received straight into a buffer of its size, handed out read-only (as bytes would be)
        out = bytearray(n + 2)
        have = len(self._buf) - self._pos
        out[:have] = memoryview(self._buf)[self._pos:]
        view = memoryview(out)
        while have < n + 2:
            got = self._sock.recv_into(view[have:])
            if not got:
                raise redis.ConnectionError("Connection closed by server.")
            have += got
        self._buf, self._pos = b"", 0
        return view[:n].toreadonly()


@dataclass
class _Entry:
    id: str
    transitions: int
    version: int
    row_bytes: int  # the most bytes one of its rows takes in a sample (stores.row_bytes; reloaded: the mean)


def redact_url(url: str) -> str:
    """The URL as it may appear in errors and logs: without its password."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<unparseable URL>"
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _safe_key_part(text: str, fallback: str) -> str:
    """A path component an object store accepts (no '/', '..' or empty parts)."""
    safe = re.sub(r"[^A-Za-z0-9_.=-]", "_", text)[:128]
    return safe if safe.strip(".") else fallback


class _Columns:
    """The window's transitions laid out row after row, oldest first, one array per tensor: a uniform sample is
    then one fancy index per tensor instead of a gather per batch. Holds the first ``batches`` batches of the
    window, all of one layout (names, dtypes, per-transition shapes); rows are appended at the tail when a sample
    needs them (so puts never pay for the copy), evicted from the head, and compacted rarely (the arrays keep
    room for twice the live rows)."""

    def __init__(self) -> None:
        self.batches = 0
        self.layout: tuple | None = None
        self.arrays: dict[str, np.ndarray] = {}
        self.versions = np.empty(0, np.int64)
        self.head = self.tail = 0

    @property
    def rows(self) -> int:
        return self.tail - self.head

    def append(self, batch: TensorBatch) -> bool:
        """Add the batch's rows; False (and nothing added) if its layout differs or it holds ragged or non-numpy
        fields (those are sampled by gather_rows instead)."""
        rows = batch.flatten().tensors
        if any(type(v) is not np.ndarray for v in rows.values()):
            return False
        layout = tuple((k, a.dtype.str, a.shape[1:]) for k, a in rows.items())
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            return False
        n = batch.rows
        if self.tail + n > len(self.versions):
            self._make_room(n)
        for name, a in rows.items():
            self.arrays[name][self.tail:self.tail + n] = a
        self.versions[self.tail:self.tail + n] = batch.version
        self.tail += n
        self.batches += 1
        return True

    def _make_room(self, n: int) -> None:
        live = self.rows
        size = len(self.versions)
        if live + n > size // 2:  # grow: keeping half the room free makes compactions rare (amortised O(n))
            size = max(2 * (live + n), 1024)
            arrays = {k: np.empty((size, *a.shape[1:]), a.dtype) for k, a in self._templates().items()}
            versions = np.empty(size, np.int64)
        else:
            arrays, versions = self.arrays, self.versions
        if live:  # (numpy copies overlapping ranges correctly when compacting in place)
            for k, a in arrays.items():
                a[:live] = self.arrays[k][self.head:self.tail]
            versions[:live] = self.versions[self.head:self.tail]
        self.arrays, self.versions = arrays, versions
        self.head, self.tail = 0, live

    def _templates(self) -> dict[str, np.ndarray]:
        assert self.layout is not None
        return {k: np.empty((0, *shape), np.dtype(dt)) for k, dt, shape in self.layout}

    def drop_oldest(self, n: int) -> None:
        if self.batches:
            self.head = min(self.tail, self.head + n)
            self.batches -= 1

    def take(self, flat: np.ndarray) -> TensorBatch:
        rows = self.head + flat
        tensors = {k: a[rows] for k, a in self.arrays.items()}
        versions = self.versions[rows]
        tensors["version"] = versions
        return TensorBatch(tensors, version=int(versions.min()), dims=("sample",))


class RedisStore:
    def __init__(self, url: str, run_id: str, capacity_transitions: int, *, key_prefix: str = "rlfabric",
                 object_store: Any = None, offload_bytes: int = 1 << 20, connect_timeout_s: float = 5.0,
                 retry_attempts: int = 5, retry_backoff_s: float = 0.2, cache_bytes: int = 256 << 20,
                 inline_bytes: int = INLINE_BYTES, source: str = "online"):
        """``cache_bytes`` bounds each of the two in-process copies that make reads fast: decoded batches (for
        take_onpolicy and sampling) and, while the whole window fits in half of it, the sampling columns.
        0 disables both (every read goes to Redis). ``inline_bytes``: see INLINE_BYTES."""
        if not run_id:
            raise ValueError("RedisStore needs a run_id: keys live under <replay.key_prefix>:<run_id>:")
        self.url = url
        self.run_id = run_id
        self.capacity = capacity_transitions
        self.retry_attempts = retry_attempts
        self.retry_backoff_s = retry_backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.offload_bytes = offload_bytes
        self.objects = object_store
        self.cache_bytes = cache_bytes
        self.inline_bytes = inline_bytes
        # the "online" source keeps the run's own prefix; other named sources (data sets) get theirs under src:
        self.prefix = f"{key_prefix}:{run_id}:" + ("" if source == "online" else f"src:{source}:")
        self._batch_prefix = self.prefix + "batch:"
        self._keys = [self.prefix + k for k in ("window", "stats", "take", "refs")]
        self._object_prefix = f"replay/{_safe_key_part(run_id, 'run')}" + (
            "" if source == "online" else f"/src-{_safe_key_part(source, 'source')}")
        self._window: deque[_Entry] = deque()
        self._row_bytes = WindowMax()  # the largest row_bytes of the window's entries
        self._window_rows = 0  # transitions in the mirrored window
        self._pending = 0
        self._stats: dict[str, int] = {}
        self._unflushed_samples = 0  # counted here, written with the next put/take (or at close)
        self._cache: OrderedDict[str, tuple[TensorBatch, int]] = OrderedDict()
        self._cached_bytes = 0
        self._columns: _Columns | None = None
        self._columns_blocked_by = ""  # a window batch whose layout the columns cannot hold
        self._warned_no_delete = False
        try:
            # No retries inside redis-py: the store retries whole operations (idempotent ones) with its own policy.
            self._client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout_s, socket_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0)
        except ValueError as exc:
            raise ReplayStoreError(
                f"replay.redis_url={redact_url(url)!r} is not a Redis URL ({exc}). Fix: use "
                f"redis://HOST:PORT/DB (or rediss:// for TLS, unix:///path/redis.sock)", bad_input=True) from None
        # Waits retry_backoff_s, then doubles, capped at max(2 s, retry_backoff_s).
        self._retry = Retry(ExponentialBackoff(cap=max(2.0, retry_backoff_s), base=retry_backoff_s / 2),
                            retry_attempts)
        self._scripts = {name: (body, hashlib.sha1(body.encode()).hexdigest())
                         for name, body in (("put", _PUT_LUA), ("take", _TAKE_LUA), ("clear", _CLEAR_LUA))}
        self._wire = _Wire(self._client)  # the store's own connection for puts and takes
        self._random = random.Random()  # (seeded from os.urandom)
        # what every EVALSHA sends after the script's sha: the key count and the keys
        self._key_args = b"".join(map(_bulk, [len(self._keys), *(k.encode() for k in self._keys)]))
        self._shas = {name: sha.encode() for name, (_, sha) in self._scripts.items()}
        # the constant parts of a put's MULTI/EXEC request: MULTI, SET's name, the script's sha, keys and first args
        self._batch_prefix_b = self._batch_prefix.encode()
        self._put_set = _MULTI + b"*3\r\n$3\r\nSET\r\n"
        self._put_head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b%b%b" % (
            3 + len(self._keys) + 9, self._shas["put"], self._key_args, _bulk(capacity_transitions),
            _bulk(self._batch_prefix_b))
        self._open()

    @classmethod
    def from_config(cls, replay_config: Any, run_id: str, object_store: Any = None, capacity: int | None = None,
                    **kw: Any) -> RedisStore:
        c = replay_config
        return cls(c.redis_url, run_id, capacity or c.capacity_transitions, key_prefix=c.key_prefix,
                   object_store=object_store,
                   offload_bytes=c.offload_bytes, connect_timeout_s=c.connect_timeout_s,
                   retry_attempts=c.retry_attempts, retry_backoff_s=c.retry_backoff_s, **kw)

    # ---- connection and retries -------------------------------------------------------------------------------

    def _open(self) -> None:
        """One bounded attempt (connect_timeout_s, no retries): a wrong URL or a stopped Redis fails Configure
        at once with the fix, rather than after the mid-run retry budget."""
        t0 = time.monotonic()
        try:
            self._client.ping()
            self._load_scripts()
        except redis.AuthenticationError as exc:
            raise ReplayStoreError(self._auth_message(exc), bad_input=True) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ReplayStoreUnavailable(
                f"replay: cannot reach Redis at replay.redis_url={redact_url(self.url)!r} "
                f"({exc.__class__.__name__}: {exc}; gave up after {time.monotonic() - t0:.1f}s, "
                f"replay.connect_timeout_s={self.connect_timeout_s}). Fix: start redis-server there "
                f"(e.g. `redis-server --port 6379 --appendonly yes`) or set replay.redis_url to a running Redis; "
                f"or use replay.store=memory") from None
        except redis.ResponseError as exc:
            raise self._refused("open", exc) from None
        self._warn_if_not_persistent()
        self._resync()
        if self.transitions > self.capacity:  # reopened with a smaller capacity
            self._after_put(self._run("trim", lambda: self._put_tx("", None, (0, 0, 0, "", 0, 0))), None)

    def _load_scripts(self) -> None:
        for body, _ in self._scripts.values():
            self._client.script_load(body)

    def _warn_if_not_persistent(self) -> None:
        try:
            aof = self._client.config_get("appendonly").get("appendonly")
        except redis.RedisError:
            return  # CONFIG may be disabled on managed Redis; nothing to check then
        if aof == "no":
            log.warning("Redis at %s runs without appendonly: replay data survives a replay-service restart but "
                        "not a Redis restart. Fix: start redis-server with --appendonly yes", redact_url(self.url))

    def _auth_message(self, exc: Exception) -> str:
        return (f"replay: Redis at replay.redis_url={redact_url(self.url)!r} refused the credentials ({exc}). "
                f"Fix: put the right user/password in the URL (redis://USER:PASSWORD@HOST:PORT/DB)")

    def _refused(self, what: str, exc: Exception) -> ReplayStoreError:
        text, bad_input = str(exc), True
        if text.startswith("OOM"):
            fix, bad_input = "raise Redis maxmemory, or lower replay.capacity_transitions", False
        elif "WRONGTYPE" in text:
            fix = f"keys under {self.prefix!r} hold data of another program; set another replay.key_prefix"
        elif "NOPERM" in text or "NOAUTH" in text:
            fix = "give the Redis user in replay.redis_url access to these keys and EVALSHA, or fix the password"
        else:
            fix, bad_input = "check the Redis server log", False
        return ReplayStoreError(f"replay: Redis refused {what} ({exc}). Fix: {fix}", bad_input=bad_input)

    def _on_failure(self, error: Exception, failures: int) -> None:
        if failures <= self.retry_attempts:
            log.warning("Redis connection lost (%s: %s); retry %d/%d", error.__class__.__name__, error, failures,
                        self.retry_attempts)

    def _run(self, what: str, op: Callable[[], R]) -> R:
        """Run one idempotent Redis operation with bounded retries; map failures to errors that say the fix."""
        def attempt() -> R:
            try:
                return op()
            except redis.exceptions.NoScriptError:  # Redis restarted and lost its script cache
                self._load_scripts()
                return op()

        t0 = time.monotonic()
        try:
            return self._retry.call_with_retry(
                attempt, self._on_failure, is_retryable=lambda e: not isinstance(e, redis.AuthenticationError),
                with_failure_count=True)
        except redis.AuthenticationError as exc:
            raise ReplayStoreError(self._auth_message(exc), bad_input=True) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ReplayStoreUnavailable(
                f"replay: lost Redis at replay.redis_url={redact_url(self.url)!r} during {what} "
                f"({exc.__class__.__name__}: {exc}); gave up after replay.retry_attempts={self.retry_attempts} "
                f"retries over {time.monotonic() - t0:.1f}s (replay.retry_backoff_s={self.retry_backoff_s}). "
                f"Fix: restart redis-server (with --appendonly yes the stored batches come back) or raise "
                f"replay.retry_attempts/retry_backoff_s to ride out longer outages") from None
        except redis.ResponseError as exc:
            raise self._refused(what, exc) from None

    def _evalsha(self, target: Any, name: str, *args: Any) -> Any:
        return target.evalsha(self._scripts[name][1], len(self._keys), *self._keys, *args)

    def _evalsha_request(self, name: str, args: list[Any], value: tuple[int, list[Any]] | None = None) -> list[Any]:
        """The pieces of an EVALSHA request for the script, with a value given as (length, pieces) last."""
        count = 3 + len(self._keys) + len(args) + (value is not None)
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b%b" % (
            count, self._shas[name], self._key_args, b"".join(map(_bulk, args)))
        if value is None:
            return [head]
        return [head + b"$%d\r\n" % value[0], *value[1], b"\r\n"]

    def _roundtrip(self, pieces: list[Any], replies: int = 1, expect: bytes = b"") -> Any:
        """Send one request (one or more pipelined commands) on the store's own connection (see _Wire) and return
        the last of its replies; an error reply is raised once every reply was read."""
        done = self._wire.request(pieces, replies, expect)
        for result in done:
            if isinstance(result, Exception):
                raise result
        return done[-1]

    # ---- state mirror -------------------------------------------------------------------------------------------

    def _resync(self) -> None:
        """Reload the window mirror and counters from Redis (at open, or when Redis changed under us)."""
        def load() -> list:
            p = self._client.pipeline(transaction=True)
            p.hgetall(self._keys[1])
            p.lrange(self._keys[0], 0, -1)
            return p.execute()

        stats, window = self._run("load", load)
        self._stats = {k.decode(): int(v) for k, v in stats.items()}
        self._window = deque()
        self._row_bytes.clear()
        for raw in window:
            parts = raw.split(b" ")
            if len(parts) == 5:
                # (a reloaded entry knows its bytes, not its rows' sizes: the mean row, exact for dense fields)
                n, nbytes = int(parts[1]), int(parts[3])
                entry = _Entry(parts[0].decode(), n, int(parts[2]), 8 - (-nbytes // max(n, 1)))
                self._window.append(entry)
                self._row_bytes.append(entry, entry.row_bytes)
        self._pending = min(self._stats.get("pending", 0), len(self._window))
        self._window_rows = sum(e.transitions for e in self._window)
        live = {e.id for e in self._window}
        for stale in [k for k in self._cache if k not in live]:
            self._uncache(stale)
        self._columns, self._columns_blocked_by = None, ""

    def _apply_status(self, status: bytes) -> None:
        """Take in a script's status line: b"window_len pending_len c1 ... c8" (counters in _FIELDS order)."""
        window_len, pending, *counters = map(int, status.split(b" "))
        self._stats = dict(zip(_FIELDS, counters, strict=True))
        self._pending = pending
        if window_len != len(self._window):
            log.warning("Redis replay state under %s changed outside this store (Redis restarted without "
                        "appendonly, or a second replay service uses the same run_id); reloading it", self.prefix)
            self._resync()

    def _stat(name: str, default: int = 0):  # a property factory, used only in this class body
        return property(lambda self: self._stats.get(name, default), doc=f"the '{name}' counter, kept in Redis")

    transitions = _stat("transitions")
    bytes = _stat("bytes")
    puts = _stat("puts")
    onpolicy_gets = _stat("onpolicy_gets")
    evicted = _stat("evicted")
    stale_dropped = _stat("stale_dropped")
    newest_version = _stat("newest_version", -1)
    del _stat

    @property
    def samples(self) -> int:
        """Samples served. Written to Redis with the next put or take, so a sample costs no round trip; a
        SIGKILL may lose the count of samples since then (never any data)."""
        return self._stats.get("samples", 0) + self._unflushed_samples

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def row_bytes(self) -> int:
        """The most bytes one row of the window can take in a sample (0 when empty)."""
        return self._row_bytes.value

    def __len__(self) -> int:
        return len(self._window)

    # ---- in-process copies (batches are immutable once stored, so these never go stale) ------------------------

    def _cache_put(self, bid: str, batch: TensorBatch, size: int | None = None) -> None:
        size = batch.nbytes if size is None else size
        if size > self.cache_bytes:
            return
        self._cache[bid] = (batch, size)
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            self._uncache(next(iter(self._cache)))

    def _uncache(self, bid: str) -> None:
        item = self._cache.pop(bid, None)
        if item is not None:
            self._cached_bytes -= item[1]

    def _columns_ready(self) -> bool:
        """Bring the columns up to the whole window (appending the batches put since the last sample), or return
        False when they cannot serve: caching is off, the window is too large, or a batch has another layout."""
        if not self.cache_bytes or self._columns_blocked_by or 2 * self.bytes > self.cache_bytes:
            self._columns = None
            return False
        for _ in range(2):
            columns = self._columns = self._columns or _Columns()
            if columns.batches < len(self._window):
                new = list(itertools.islice(self._window, columns.batches, None))
                batches = self._fetch([e.id for e in new], "sample")
                for e in new:
                    if not columns.append(batches[e.id]):
                        self._columns, self._columns_blocked_by = None, e.id
                        return False
            if columns.rows == self._window_rows:
                return True
            log.warning("replay sampling columns out of step with the window; rebuilding them")  # a bug if seen
            self._columns = None
        return False

    # ---- frames <-> batches -------------------------------------------------------------------------------------

    def _object_key(self, bid: str, name: str, index: int, used: set[str]) -> str:
        part = _safe_key_part(name, f"tensor{index}")
        if part in used:
            part = f"{part}~{index}"
        used.add(part)
        return f"{self._object_prefix}/{bid}/{part}"

    def _value_for(self, bid: str, batch: TensorBatch, frames: list[Any]) -> tuple[tuple[int, list[Any]], list[dict]]:
        """The batch's codec frames as one length-prefixed value (as its length and the pieces to send), with
        tensors over offload_bytes written to the object store first (so a stored header never points at a missing
        object) and left empty here."""
        refs: list[dict] = []
        if self.objects is not None:
            names = [part for name, v in batch.tensors.items()
                     for part in ((name, name + "#lengths") if isinstance(v, Ragged) else (name,))]
            used: set[str] = set()
            for i in range(1, len(frames)):
                size = len(frames[i])
                if size > self.offload_bytes:
                    key = self._object_key(bid, names[i - 1], i, used)
                    self.objects.put_bytes(key, bytes(frames[i]))
                    refs.append({"frame": i, "tensor": names[i - 1], "key": key, "bytes": size})
                    frames[i] = b""
        if refs:
            header = json.dumps({"store": STORE_FORMAT, "id": bid, "refs": refs}, separators=(",", ":")).encode()
        else:  # (the same bytes: ids hold no characters JSON escapes)
            header = b'{"store":%d,"id":"%b","refs":[]}' % (STORE_FORMAT, bid.encode())
        return frame_parts([header, *frames]), refs

    def _decode(self, bid: str, value: bytes) -> TensorBatch:
        try:
            stored = unpack_frames(value)
            header = json.loads(stored[0].tobytes())
            frames: list[Any] = stored[1:]
            for ref in header.get("refs", []):
                if not self._own_object(bid, ref["key"]):
                    raise ValueError(f"it names object {str(ref['key'])[:200]!r}, not one of its own tensors")
                frames[ref["frame"]] = self._get_object(ref["key"])
            _, batch = decode(frames, _DECODE_BOUND)
        except (ValueError, KeyError, TypeError, IndexError, FrameError, struct.error) as exc:
            raise ReplayStoreError(f"replay: stored batch {self._batch_prefix}{bid} is unreadable "
                                   f"({exc.__class__.__name__}: {exc}). Fix: Clear the replay (or delete the key); "
                                   f"was it written by another program under replay.key_prefix?") from None
        return batch

    def _get_object(self, key: str) -> bytes:
        if self.objects is None:
            raise ReplayStoreError(f"replay: batch references object {key!r} but this replay has no object store. "
                                   f"Fix: configure storage (storage.root or S3) as the run that wrote it did")
        try:
            return self.objects.get_bytes(key)
        except FileNotFoundError:
            raise ReplayStoreError(f"replay: offloaded tensor {key!r} is missing from the object store. Fix: point "
                                   f"storage at the store the run used (storage.root / storage.bucket)") from None

    def _own_object(self, bid: str, key: Any) -> bool:
        """Whether ``key`` is one this store writes for batch ``bid`` (``<object prefix>/<id>/<tensor>``). Redis
        state names the keys to read and delete, and whoever can write Redis could name any object (a checkpoint):
        a key that is not the batch's own is logged, counted and left alone."""
        if isinstance(key, str) and _BATCH_ID.fullmatch(bid):
            head = f"{self._object_prefix}/{bid}/"
            part = key[len(head):]
            if key.startswith(head) and _KEY_PART.fullmatch(part) and part.strip("."):
                return True
        FOREIGN_REFS.inc()
        log.error("replay: Redis under %s names object %s for batch %s, which is not one of that batch's offloaded "
                  "tensors (%s/<batch id>/<tensor>); ignored, not read or deleted. Fix: find who writes these keys "
                  "(give Redis a password: replay.redis_url redis://:PASSWORD@HOST:PORT/DB)", self.prefix,
                  str(key)[:200], bid[:80], self._object_prefix)
        return False

    def _delete_objects(self, refs: list[tuple[bytes, bytes]]) -> None:
        """Delete the offloaded tensors that (batch id, refs JSON) pairs name, those that are the batch's own."""
        keys = []
        for raw_id, raw in refs:
            bid = raw_id.decode(errors="replace") if isinstance(raw_id, bytes) else str(raw_id)
            try:
                named = json.loads(raw)
            except (ValueError, TypeError):
                named = [raw]
            keys += [key for key in (named if isinstance(named, list) else [named]) if self._own_object(bid, key)]
        self._delete_keys(keys)

    def _delete_keys(self, keys: list[str]) -> None:
        if self.objects is None:
            return
        for key in keys:
            try:
                self.objects.delete(key)
            except (NotImplementedError, AttributeError):
                if not self._warned_no_delete:
                    self._warned_no_delete = True
                    log.warning("object store %s has no delete(): offloaded tensors of evicted replay batches stay "
                                "under %s/", type(self.objects).__name__, self._object_prefix)
                return
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 — a leaked object must not fail a put
                log.warning("could not delete offloaded replay object %s: %s", key, exc)

    # ---- the store operations -----------------------------------------------------------------------------------

    def _put_tx(self, bid: str, value: tuple[int, list[Any]] | None, args: tuple) -> bytes:
        """The batch's value (length, pieces) and the bookkeeping script (which also evicts), atomically: inside
        the script call for tiny values, else SET and the script in one MULTI/EXEC. One request either way."""
        if value is None or value[0] <= self.inline_bytes:
            return self._roundtrip(self._evalsha_request("put", [self.capacity, self._batch_prefix, bid, *args],
                                                         value))
        # MULTI, SET batch:<id> <value> (a retry rewrites the same value), EVALSHA put ..., EXEC; the script's
        # arguments after the constant ones are ints, the id and JSON: ASCII, so characters are bytes
        n, version, nbytes, refs, samples, puts = map(str, args)
        script = (f"${len(bid)}\r\n{bid}\r\n${len(n)}\r\n{n}\r\n${len(version)}\r\n{version}\r\n"
                  f"${len(nbytes)}\r\n{nbytes}\r\n${len(refs)}\r\n{refs}\r\n${len(samples)}\r\n{samples}\r\n"
                  f"${len(puts)}\r\n{puts}\r\n").encode("ascii")
        set_head = b"%b$%d\r\n%b%b\r\n$%d\r\n" % (self._put_set, len(self._batch_prefix_b) + len(bid),
                                                 self._batch_prefix_b, bid.encode(), value[0])
        pieces = [set_head, *value[1], b"\r\n%b%b%b" % (self._put_head, script, _EXEC)]
        if value[0] <= _BIG_PIECE:
            pieces = [b"".join(pieces)]
        done = self._roundtrip(pieces, 4, _PUT_EXEC)  # +OK, QUEUED, QUEUED, then EXEC's [OK, script reply]
        for result in done:
            if isinstance(result, Exception):
                raise result
        return done[-1]

    def _after_put(self, reply: bytes, entry: _Entry | None) -> None:
        status, *evicted = reply.split(b"\n")
        if entry is not None:
            # (applied == 0 means an earlier attempt whose reply was lost stored it: still ours to mirror)
            self._window.append(entry)
            self._row_bytes.append(entry, entry.row_bytes)
            self._window_rows += entry.transitions
        for raw in evicted[0::2]:
            bid = raw.decode()
            if self._window and self._window[0].id == bid:
                old = self._window.popleft()
                self._row_bytes.evict(old)
                self._window_rows -= old.transitions
                if self._columns is not None:
                    self._columns.drop_oldest(old.transitions)
            self._uncache(bid)
            if bid == self._columns_blocked_by:
                self._columns_blocked_by = ""
        if any(evicted[1::2]):
            self._delete_objects([(bid, h) for bid, h in zip(evicted[0::2], evicted[1::2], strict=True) if h])
        self._apply_status(status)

    def put(self, batch: TensorBatch) -> int:
        """Store the batch; returns the put count. Returns only once Redis has it (the caller then acknowledges).
        Like MemoryStore, the store keeps references to the batch's arrays: don't modify them afterwards."""
        n = check_batch(batch, self.capacity)
        puts = self._stats.get("puts", 0) + 1  # (this put's count: the script's retry check)
        bid = f"{puts:010d}-{self._random.getrandbits(32):08x}"  # (unique, not secret)
        frames, nbytes = _batch_frames(batch)
        value, refs = self._value_for(bid, batch, frames)
        samples = self._unflushed_samples
        refs_json = json.dumps([r["key"] for r in refs]) if refs else ""
        args = (n, batch.version, nbytes, refs_json, samples, puts)
        try:
            reply = self._run("put", lambda: self._put_tx(bid, value, args))
        except ReplayStoreError:
            self._delete_keys([r["key"] for r in refs])  # not acknowledged: leave none of its objects behind
            raise
        self._unflushed_samples -= samples
        if self.cache_bytes:
            self._cache_put(bid, TensorBatch(dict(batch.tensors), meta=dict(batch.meta), version=batch.version,
                                             seq=batch.seq, dims=batch.dims, field_dims=dict(batch.field_dims)),
                            nbytes)
        self._after_put(reply, _Entry(bid, n, batch.version, row_bytes(batch, n)))
        return self.puts

    def take_onpolicy(self, min_version: int) -> TensorBatch | None:
        """Oldest unconsumed batch with version >= min_version; older ones are dropped and counted."""
        if not self._pending:
            return None
        token = f"{self._random.getrandbits(64):016x}"  # a retried take answers with what the first attempt took
        samples = self._unflushed_samples
        # pending is always the newest entries of the window, so the mirror knows which batch the take will pop
        # (the oldest pending one new enough): ask Redis for its value too unless it is cached here.
        expect = None
        for e in itertools.islice(reversed(self._window), self._pending):
            if e.version >= min_version:
                expect = e.id
        want_value = "1" if expect is None or expect not in self._cache else "0"
        found, status, value = self._run("take", lambda: self._roundtrip(self._evalsha_request(
            "take", [min_version, token, samples, want_value, self._batch_prefix])))
        self._unflushed_samples -= samples
        self._apply_status(status)
        if not found:
            return None
        bid = found.decode()
        if value:
            batch = self._decode(bid, value)
            if self.cache_bytes:
                self._cache_put(bid, batch)
            return batch
        return self._fetch([bid], "take")[bid]

    def _fetch(self, ids: list[str], what: str = "read") -> dict[str, TensorBatch]:
        """Batches by id: from the cache, else in one pipelined round trip."""
        out: dict[str, TensorBatch] = {}
        missing = []
        for bid in ids:
            item = self._cache.get(bid)
            if item is None:
                missing.append(bid)
            else:
                self._cache.move_to_end(bid)
                out[bid] = item[0]
        if not missing:
            return out

        values = self._run(what, lambda: self._client.mget([self._batch_prefix + bid for bid in missing]))
        for bid, stored in zip(missing, values, strict=True):
            if stored is None:
                self._resync()
                raise ReplayStoreError(
                    f"replay: batch {self._batch_prefix}{bid} vanished from Redis (Redis restarted without "
                    f"appendonly, or another replay service uses run_id {self.run_id!r}); the replay state was "
                    f"reloaded, request again. Fix: run redis-server with --appendonly yes")
            batch = self._decode(bid, stored)
            out[bid] = batch
            if self.cache_bytes:
                self._cache_put(bid, batch)
        return out

    def sample(self, n: int, rng: np.random.Generator) -> TensorBatch:
        """n rows drawn uniformly over the window (the same draws as MemoryStore.sample)."""
        if not self._window:
            raise ValueError("replay is empty: nothing to sample yet")
        if self._columns_ready():
            assert self._columns is not None
            out = self._columns.take(rng.integers(0, self._window_rows, size=n))
        else:
            counts = np.array([e.transitions for e in self._window])
            flat, owner = draw_rows(counts, n, rng)
            ids = [e.id for e in self._window]
            batches = self._fetch([ids[b] for b in np.unique(owner)], "sample")
            out = gather_rows([batches.get(i) for i in ids], counts, flat, owner)
        self._unflushed_samples += 1
        return out

    def sample_windows(self, n: int, length: int, rng: np.random.Generator) -> TensorBatch:
        """n windows of ``length`` consecutive steps, uniform over every window the stored trajectories hold."""
        ids = [e.id for e in self._window]
        batches = self._fetch(ids, "sample")
        out = sample_windows([batches[i] for i in ids], n, length, rng)
        self._unflushed_samples += 1
        return out

    def drop_pending(self) -> int:
        """Forget the on-policy FIFO (batches not yet taken) but keep the window; returns how many were dropped."""
        dropped = self._pending
        if dropped:
            def drop() -> None:
                p = self._client.pipeline(transaction=True)
                p.hset(self._keys[1], "pending", 0)
                p.hincrby(self._keys[1], "stale_dropped", dropped)
                p.execute()

            self._run("drop pending", drop)
            self._pending = 0
            self._stats["stale_dropped"] = self._stats.get("stale_dropped", 0) + dropped
        return dropped

    def clear(self) -> None:
        """Drop every stored batch (and its offloaded objects); the counters stay, as MemoryStore's do."""
        refs, status = self._run("clear", lambda: self._evalsha(self._client, "clear", self._batch_prefix))
        self._window.clear()
        self._row_bytes.clear()
        self._window_rows = 0
        self._cache.clear()
        self._cached_bytes = 0
        self._columns, self._columns_blocked_by = None, ""
        self._apply_status(status)
        self._delete_objects(list(zip(refs[0::2], refs[1::2], strict=True)))

    def close(self) -> None:
        """Write the sample count and disconnect; the data stays in Redis for the next replay service."""
        if self._unflushed_samples:
            try:
                self._client.hincrby(self._keys[1], "samples", self._unflushed_samples)
                self._unflushed_samples = 0
            except redis.RedisError as exc:
                log.warning("could not write the replay sample count to Redis at close: %s", exc)
        self._cache.clear()
        self._cached_bytes = 0
        self._columns = None
        self._wire.release()
        self._client.close()
