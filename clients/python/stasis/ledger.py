"""An episode's token ledger, read and verified as ``stasis ledger`` does.

The gateway appends every model call of an episode to STATE/gateway/ledgers/
EPISODE.ledger: JSON lines, each hash-chained to the one before it (see the
Go package ``stasis/ledger`` for the format). The logical ledger, what the
harness has acted on, is the entries up to the last cut plus those appended
after it; that is what a trainer batches: each entry's prompt and
completion token ids and the completion's logprobs.

The API serves no ledger: these functions read the file, so they need the
server's state directory on a file system this process can read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from .errors import LedgerError
from .models import parse_time

__all__ = [
    "Tokens",
    "LedgerEntry",
    "LedgerEvent",
    "Ledger",
    "LedgerProblem",
    "LedgerReport",
    "LedgerNotFound",
    "ledger_path",
    "read_ledger",
    "verify_ledger",
    "DELIVERED",
    "ABANDONED",
    "PENDING",
    "UNDELIVERED",
]

DELIVERED, ABANDONED, PENDING, UNDELIVERED = "delivered", "abandoned", "pending", "undelivered"

_FORMAT_V1, _FORMAT = 1, 2
_HASH_KEY = b'"hash":"'
_HASH_LEN = 64
_EPISODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_HEX_RE = re.compile(rb"^[0-9a-f]{64}$")


class LedgerNotFound(LedgerError, FileNotFoundError):
    """The episode has no ledger (yet) in that directory."""


@dataclass
class Tokens:
    """The token ids and logprobs of one call, as the model server gave
    them (vLLM's and SGLang's extensions)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per completion token


@dataclass
class LedgerEntry:
    """One model call of the logical ledger."""

    seq: int  # 1-based position in the logical ledger
    call_id: str  # "<episode>/<n>", the same when the call is issued again
    attempt: int  # the episode's attempt that made it
    parent: str
    request: Any  # the request body as the model server got it
    response: Any  # the whole response
    usage: Any
    tokens: Optional[Tokens]
    started: Optional[datetime]
    finished: Optional[datetime]
    boundary: bool  # the first entry after a relaunch match: training masks it
    hash: str
    disposition: str  # delivered, abandoned, pending or (dropped by a cut) undelivered


@dataclass
class LedgerEvent:
    """A cut or a broken mark, with the file's line that holds it."""

    line: int
    kind: str  # "cut" or "broken"
    to: int  # cut: the new length; broken: the length then
    from_: int  # the logical length before
    reason: str
    boundary: bool
    at: Optional[datetime]


@dataclass
class Ledger:
    """An episode's ledger file as ``stasis ledger show --json`` shows it."""

    path: str
    episode: str
    format: int
    entries: list[LedgerEntry]  # the logical ledger
    dropped: list[LedgerEntry]  # entries cuts dropped, in file order
    events: list[LedgerEvent]
    total: int  # entry records in the file, cut ones included
    broken: bool  # the history cannot be trusted: do not train on it
    reason: str = ""
    torn_bytes: int = 0

    @property
    def token_count(self) -> int:
        """Completion tokens over the logical ledger."""
        return sum(len(e.tokens.completion_token_ids) for e in self.entries if e.tokens)

    def completion_token_ids(self) -> list[int]:
        """The completion token ids of every entry, in order."""
        return [t for e in self.entries if e.tokens for t in e.tokens.completion_token_ids]

    def logprobs(self) -> list[float]:
        """The completion logprobs of every entry, in order."""
        return [x for e in self.entries if e.tokens for x in e.tokens.logprobs]


@dataclass
class LedgerProblem:
    """The first bad record of a file."""

    line: int
    what: str
    seq: int = 0
    kind: str = ""

    def __str__(self) -> str:
        where = f" (seq {self.seq})" if self.seq > 0 else (f" ({self.kind})" if self.kind else "")
        return f"line {self.line}{where}: {self.what}"


@dataclass
class LedgerReport:
    """What a verify found (``stasis ledger verify --json``)."""

    path: str
    episode: str
    format: int
    ok: bool
    bad: Optional[LedgerProblem]
    records: int
    entries: int
    live: int
    cuts: int
    broken: bool
    broken_reason: str
    head: str
    delivered: int
    abandoned: int
    pending: int
    undelivered: int
    torn_bytes: int = 0


class _Bad(Exception):
    pass


def ledger_path(directory: str | os.PathLike, episode: str) -> str:
    """DIR/EPISODE.ledger, for a valid episode name."""
    if not _EPISODE_RE.match(episode):
        raise ValueError(f"episode name {episode!r}: 1 to 200 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return os.path.join(os.fspath(directory), episode + ".ledger")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _decode_record(line: bytes) -> tuple[Optional[dict], Optional[str]]:
    """Parse one line and check its hash covers it (as ledger.decodeRecord).
    On a hash mismatch the record comes back too, to name it."""
    n = len(line)
    tail = len(_HASH_KEY) + _HASH_LEN + 2
    if (
        n < tail + 1
        or line[:1] != b"{"
        or not line.endswith(b'"}')
        or line[n - tail : n - tail + len(_HASH_KEY)] != _HASH_KEY
        or line[n - tail - 1 : n - tail] not in (b",", b"{")
    ):
        return None, 'not a ledger record: a line must be a JSON object ending with "hash":"<64 hex digits>"}'
    want = line[n - 2 - _HASH_LEN : n - 2]
    if not _HEX_RE.match(want):
        return None, "not a ledger record: the hash must be 64 lowercase hex digits"
    try:
        r = json.loads(line)
    except ValueError as e:
        return None, f"not a ledger record: {e}"
    if not isinstance(r, dict):
        return None, "not a ledger record: not a JSON object"
    if r.get("hash") != want.decode():
        return None, 'not a ledger record: "hash" must be the last field'
    if hashlib.sha256(line[: n - 2 - _HASH_LEN] + b'"}').hexdigest() != r["hash"]:
        return r, "hash mismatch: the record was changed after it was written"
    try:
        _check(r)
    except _Bad as e:
        return None, str(e)
    return r, None


def _time(r: dict, key: str) -> Optional[datetime]:
    v = r.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _Bad(f"not a ledger record: {key} is not a time")
    try:
        return parse_time(v)
    except ValueError as e:
        raise _Bad(f"not a ledger record: {e}") from None


def _check(r: dict) -> None:
    """The fields a record of its kind needs (ledger.record.check)."""
    kind = r.get("kind")
    if not isinstance(kind, str):
        raise _Bad("not a ledger record: no kind")
    for key in ("seq", "attempt", "format"):
        if key in r and not _is_int(r[key]):
            raise _Bad(f"not a ledger record: {key} is not an integer")
    parent = r.get("parent", "")
    if not isinstance(parent, str) or (parent and not _HEX_RE.match(parent.encode())):
        raise _Bad(f"{kind} record: parent {parent!r} is not a record hash")
    for key in ("started", "finished", "at"):
        _time(r, key)
    if kind == "ledger":
        fmt = r.get("format", 0)
        if not (_FORMAT_V1 <= fmt <= _FORMAT):
            raise _Bad(f"ledger header: format {fmt}; this client reads formats {_FORMAT_V1} to {_FORMAT} (a newer stasis wrote it?)")
        ep = r.get("episode", "")
        if not isinstance(ep, str) or not _EPISODE_RE.match(ep):
            raise _Bad(f"ledger header: episode name {ep!r} is not valid")
    elif kind == "entry":
        seq = r.get("seq", 0)
        if seq < 1:
            raise _Bad(f"entry record: seq {seq} must be at least 1")
        if not r.get("call_id"):
            raise _Bad(f"entry record {seq}: empty call_id")
        if r.get("response") is None:
            raise _Bad(f"entry record {seq}: no response")
    elif kind == "cut":
        to = r.get("to")
        if not _is_int(to) or to < 0:
            raise _Bad('cut record: "to" must be a position of at least 0')
    elif kind == "broken":
        if not r.get("reason"):
            raise _Bad("broken record: no reason")
    elif kind == "settle":
        settled = r.get("settled")
        if not isinstance(settled, list) or not settled:
            raise _Bad('settle record: "settled" names no entry')
        for s in settled:
            if not isinstance(s, dict):
                raise _Bad("settle record: a settlement is not an object")
            seq, cid, d = s.get("seq", 0), s.get("call_id", ""), s.get("disposition", "")
            if not _is_int(seq) or seq < 1:
                raise _Bad(f"settle record: seq {seq} (call {cid!r}): an entry's seq is at least 1")
            if not cid:
                raise _Bad(f"settle record: seq {seq}: empty call id: a settlement names its entry by seq and call id")
            if d not in (DELIVERED, ABANDONED):
                raise _Bad(f"settle record: seq {seq} (call {cid}): disposition {d!r}: settle an entry {DELIVERED!r} or {ABANDONED!r}")
    else:
        raise _Bad(f"unknown record kind {kind!r} (written by a newer stasis?)")


def _tokens(v: Any) -> Optional[Tokens]:
    if not isinstance(v, dict):
        return None
    return Tokens(
        prompt_token_ids=[int(x) for x in v.get("prompt_token_ids") or []],
        completion_token_ids=[int(x) for x in v.get("completion_token_ids") or []],
        logprobs=[float(x) for x in v.get("logprobs") or []],
    )


class _State:
    """What the records of a file add up to (ledger.state)."""

    def __init__(self, episode: str, keep_dropped: bool):
        self.episode = episode
        self.format = 0
        self.records = 0
        self.off = 0
        self.head = ""
        self.entries: list[LedgerEntry] = []
        self.settled: list[bool] = []
        self.index: dict[str, int] = {}
        self.next_boundary = False
        self.broken = False
        self.reason = ""
        self.total = 0
        self.events: list[LedgerEvent] = []
        self.keep_dropped = keep_dropped
        self.dropped: list[LedgerEntry] = []
        self.drop_counts: dict[str, int] = {}

    def unsettled(self) -> str:
        return DELIVERED if self.format == _FORMAT_V1 else PENDING

    def apply(self, r: dict) -> None:
        parent, kind = r.get("parent", ""), r["kind"]
        if parent != self.head:
            if self.head == "":
                raise _Bad(f"parent {parent[:12]}… but this is the first record (its parent must be empty): lines were removed before it")
            raise _Bad(f"parent {parent[:12]}… is not the previous record's hash {self.head[:12]}…: a record was removed, inserted or reordered")
        if (self.records == 0) != (kind == "ledger"):
            if self.records == 0:
                raise _Bad(f'the first record is a {kind} record; a ledger starts with its header (kind "ledger")')
            raise _Bad("a second ledger header: two ledgers were concatenated")
        n = len(self.entries)
        if kind == "ledger":
            if r.get("episode") != self.episode:
                raise _Bad(f"this is the ledger of episode {r.get('episode')!r}, not {self.episode!r}: the file was renamed or copied")
            self.format = r.get("format", 0)
        elif kind == "entry":
            seq, cid = r["seq"], r["call_id"]
            if seq != n + 1:
                raise _Bad(f"seq {seq}, but the logical ledger has {n} entries here, so it must be {n + 1}")
            if cid in self.index:
                raise _Bad(f"call {cid} is already live at seq {self.index[cid] + 1}: a call is recorded once")
            self.index[cid] = n
            self.entries.append(
                LedgerEntry(
                    seq=seq,
                    call_id=cid,
                    attempt=r.get("attempt", 0),
                    parent=parent,
                    request=r.get("request"),
                    response=r.get("response"),
                    usage=r.get("usage"),
                    tokens=_tokens(r.get("tokens")),
                    started=_time(r, "started"),
                    finished=_time(r, "finished"),
                    boundary=bool(r.get("boundary", False)),
                    hash=r["hash"],
                    disposition=self.unsettled(),
                )
            )
            self.settled.append(False)
            self.next_boundary = False
            self.total += 1
        elif kind == "cut":
            to = r["to"]
            if to > n:
                raise _Bad(f"cut to {to}, but the logical ledger has only {n} entries here")
            for i, e in enumerate(self.entries[to:]):
                del self.index[e.call_id]
                d = e.disposition if self.settled[to + i] else UNDELIVERED
                self.drop_counts[d] = self.drop_counts.get(d, 0) + 1
                if self.keep_dropped:
                    self.dropped.append(dataclasses.replace(e, disposition=d))
            self.entries = self.entries[:to]
            self.settled = self.settled[:to]
            self.next_boundary = bool(r.get("boundary", False))
            self.events.append(LedgerEvent(self.records + 1, "cut", to, n, r.get("reason", ""), bool(r.get("boundary", False)), _time(r, "at")))
        elif kind == "broken":
            self.broken, self.reason = True, r.get("reason", "")
            self.events.append(LedgerEvent(self.records + 1, "broken", n, n, self.reason, False, _time(r, "at")))
        elif kind == "settle":
            for seq, d in self._check_settle(r["settled"]):
                self.entries[seq - 1].disposition = d
                self.settled[seq - 1] = True
        self.head = r["hash"]
        self.records += 1

    def _check_settle(self, ss: list[dict]) -> list[tuple[int, str]]:
        n = len(self.entries)
        fresh: list[tuple[int, str]] = []
        seen: dict[int, str] = {}
        for x in ss:
            seq, cid, d = x["seq"], x["call_id"], x["disposition"]
            if seq > n:
                raise _Bad(f"settle record: seq {seq} (call {cid}) is not a live entry: the logical ledger has {n} entries")
            e = self.entries[seq - 1]
            if e.call_id != cid:
                raise _Bad(f"settle record: seq {seq} is call {e.call_id}, not {cid}: a settlement names its entry by both")
            if seq in seen:
                if seen[seq] != d:
                    raise _Bad(f"settle record: seq {seq} (call {cid}) is settled both {seen[seq]} and {d}")
                continue
            seen[seq] = d
            if self.settled[seq - 1]:
                if e.disposition != d:
                    raise _Bad(f"settle record: seq {seq} (call {cid}) was settled {e.disposition}; it cannot become {d}")
                continue
            fresh.append((seq, d))
        return fresh


def _load(data: bytes, episode: str, keep_dropped: bool) -> tuple[_State, Optional[LedgerProblem]]:
    st = _State(episode, keep_dropped)
    off = 0
    while off < len(data):
        i = data.find(b"\n", off)
        if i < 0:
            break  # a torn last line: never acknowledged, ignored
        r, err = _decode_record(data[off:i])
        if err is None:
            try:
                st.apply(r)  # type: ignore[arg-type]
            except _Bad as e:
                err = str(e)
        if err is not None:
            p = LedgerProblem(line=st.records + 1, what=err)
            if r is not None:
                p.kind = r.get("kind", "") if isinstance(r.get("kind"), str) else ""
                p.seq = r.get("seq", 0) if _is_int(r.get("seq")) else 0
            return st, p
        off = i + 1
        st.off = off
    return st, None


def _read(directory: str | os.PathLike, episode: str) -> tuple[str, bytes]:
    path = ledger_path(directory, episode)
    try:
        with open(path, "rb") as f:
            return path, f.read()
    except FileNotFoundError:
        raise LedgerNotFound(f"no ledger for episode {episode!r} in {os.fspath(directory)}") from None
    except OSError as e:
        raise LedgerError(f"ledger of episode {episode}: {e}") from e


def read_ledger(directory: str | os.PathLike, episode: str) -> Ledger:
    """The ledger of episode in directory (STATE/gateway/ledgers for a
    server's), without locking it: a gateway may be appending. A damaged
    file raises LedgerError (verify_ledger says where)."""
    path, data = _read(directory, episode)
    st, prob = _load(data, episode, keep_dropped=True)
    if prob is not None:
        raise LedgerError(f"ledger {path}: ledger file is damaged: {prob}")
    return Ledger(
        path=path,
        episode=episode,
        format=st.format,
        entries=st.entries,
        dropped=st.dropped,
        events=st.events,
        total=st.total,
        broken=st.broken,
        reason=st.reason,
        torn_bytes=len(data) - st.off,
    )


def verify_ledger(directory: str | os.PathLike, episode: str) -> LedgerReport:
    """Walk the whole ledger of episode: every hash, every parent link,
    every sequence number. A damaged file is not an error: the report's
    ``bad`` names the first bad record and ``ok`` is False."""
    path, data = _read(directory, episode)
    st, prob = _load(data, episode, keep_dropped=False)
    counts = dict(st.drop_counts)
    for e in st.entries:
        counts[e.disposition] = counts.get(e.disposition, 0) + 1
    return LedgerReport(
        path=path,
        episode=episode,
        format=st.format,
        ok=prob is None,
        bad=prob,
        records=st.records,
        entries=st.total,
        live=len(st.entries),
        cuts=sum(1 for e in st.events if e.kind == "cut"),
        broken=st.broken,
        broken_reason=st.reason,
        head=st.head,
        delivered=counts.get(DELIVERED, 0),
        abandoned=counts.get(ABANDONED, 0),
        pending=counts.get(PENDING, 0),
        undelivered=counts.get(UNDELIVERED, 0),
        torn_bytes=len(data) - st.off if prob is None else 0,
    )
