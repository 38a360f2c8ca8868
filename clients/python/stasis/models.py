"""Typed views of what the stasis server sends and takes.

Each dataclass mirrors one schema of ``internal/control/openapi/server.json`` (named in its
``__schema__``): one field per property, with the property's JSON name (or,
where that is a Python keyword, a field whose ``metadata={"json": NAME}``
gives it: ``LedgerEvent.from_`` is ``"from"``). A
property the schema requires is a field without a default; a nullable one is
``X | None``; an enum is a ``Literal``; a ``date-time`` is a ``datetime``; a
property of any JSON value (no type) is ``Any``.
What the server sends beyond the schema is kept, undecoded, in ``extra``, so
a newer server never breaks an older client. A test
(``tests/test_openapi.py``) holds these classes to the document.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar, Literal, Optional, Union

__all__ = [
    "Identity",
    "Receipt",
    "SupervisorStatus",
    "Episode",
    "Verdict",
    "VerifyResult",
    "Limits",
    "ClockFix",
    "EpisodeFigures",
    "CheckpointResult",
    "CheckpointShare",
    "RestoreResult",
    "Restore",
    "RestoreShare",
    "Checkpoint",
    "CheckpointRecord",
    "CheckpointDetail",
    "CheckpointProgress",
    "FreedSnapshot",
    "StartRequest",
    "CheckpointRequest",
    "RestoreRequest",
    "BranchRequest",
    "Tokens",
    "LedgerEntry",
    "LedgerEvent",
    "Ledger",
    "LedgerProblem",
    "LedgerReport",
    "TaskSummary",
    "json_name",
    "decode",
    "encode",
    "parse_time",
]

EpisodeState = Literal["running", "ended", "retired", "lost"]
SupervisorState = Literal["running", "paused", "stopping", "exited"]
PauseMode = Literal["stop", "hold", "hold+freeze"]
VerdictStatus = Literal["resolved", "unresolved", "error"]
CheckpointState = Literal["pending", "committed", "failed"]
Harness = Literal["mini", "opencode"]
Provider = Literal["local", "microvm", "e2b", "opensandbox"]
Stragglers = Literal["exclude", "fail"]
ClockPolicy = Literal["continuous", "host"]
Disposition = Literal["delivered", "abandoned", "pending", "undelivered"]
LedgerEventKind = Literal["cut", "broken", "branch"]
ShareState = Literal["pending", "prepared", "failed"]  # a node's share of a checkpoint
RestoreState = Literal["pending", "go", "aborted"]  # a restore over several nodes
RestoreShareState = Literal["pending", "ready", "failed", "done"]  # a node's share of a restore


def _extra() -> Any:
    return field(default_factory=dict, repr=False, compare=False, metadata={"extra": True})


# --- the supervisor -----------------------------------------------------


@dataclass
class Identity:
    """A supervisor's PID and start time in clock ticks since boot."""

    __schema__: ClassVar[str] = "Identity"
    pid: int
    start_time: int
    extra: dict[str, Any] = _extra()


@dataclass
class Receipt:
    """How a supervisor ended (receipt.json)."""

    __schema__: ClassVar[str] = "Receipt"
    identity: Optional[Identity] = None
    mode: Optional[PauseMode] = None  # the launch's pause mode
    seq: int = 0  # the launch's last pause number
    cleanup_confirmed: bool = False
    return_code: Optional[int] = None
    timed_out: bool = False
    stopped: bool = False
    relaunches: int = 0
    error: str = ""
    paused_total_s: float = 0.0
    wall: float = 0.0
    leftover_pids: list[int] = field(default_factory=list)
    extra: dict[str, Any] = _extra()


@dataclass
class SupervisorStatus:
    """A live episode's supervisor status (``stasis ctl status``)."""

    __schema__: ClassVar[str] = "SupervisorStatus"
    state: Optional[SupervisorState] = None
    mode: Optional[PauseMode] = None
    seq: int = 0
    confirmed: Optional[bool] = None
    identity: Optional[Identity] = None
    harness_pid: int = 0
    relaunches: int = 0
    deadline_left_s: Optional[float] = None
    paused_total_s: float = 0.0
    receipt: Optional[Receipt] = None
    frozen: bool = False
    extra: dict[str, Any] = _extra()


# --- episodes -------------------------------------------------------------


@dataclass
class Episode:
    """An episode as the API shows it: its record, and what the server knows
    of it now (``live``, the supervisor's ``status``, the ledger's length and
    health, the recorded verdict)."""

    __schema__: ClassVar[str] = "Episode"
    id: str
    task: str
    harness: str
    provider: str
    sandbox: str
    attempt: int
    pause_seq: int
    state: EpisodeState
    created: datetime
    updated: datetime
    live: bool
    status: Optional[SupervisorStatus]
    model_calls: int
    ledger_ok: bool
    reward: Optional[int]
    origin: str = ""
    node: str = ""  # the node that drives it, of several on one store ("" for a server on its own)
    deadline_s: Optional[float] = None  # when the start gave one (None: the task's budget)
    limits: Optional[Limits] = None  # when the start gave some
    resume: Optional[Literal["in_place", "relaunch"]] = None
    image: str = ""
    environment: str = ""  # host, venv:KEY or image:DIGEST
    status_error: str = ""
    verdict: Optional[VerdictStatus] = None
    token_path: str = ""
    extra: dict[str, Any] = _extra()

    @property
    def harness_ended(self) -> bool:
        """The harness has ended: the episode can be verified. (``state``
        is ``ended`` once the server has seen the harness exit; a live
        status that says ``exited`` counts too, for the moment before.)"""
        return self.state == "ended" or (self.status is not None and self.status.state == "exited")


@dataclass
class Verdict:
    """What the task's tests said of an episode's work tree."""

    __schema__: ClassVar[str] = "Verdict"
    episode: str
    attempt: int
    task: str
    status: VerdictStatus
    reward: Literal[0, 1]
    reason: str = ""
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    environment: str = ""
    tests_restored: int = 0
    tests_removed: list[str] = field(default_factory=list)
    tests_reverted: list[str] = field(default_factory=list)
    exit_code: int = 0
    timed_out: bool = False
    output: str = ""
    output_bytes: int = 0
    started: Optional[datetime] = None
    duration_s: float = 0.0
    extra: dict[str, Any] = _extra()


@dataclass
class VerifyResult:
    """The answer to a verify: the verdict, and whether it was recorded
    before this call (then nothing ran)."""

    __schema__: ClassVar[str] = "VerifyResponse"
    verdict: Verdict
    recorded: bool
    extra: dict[str, Any] = _extra()


@dataclass
class Limits:
    """Bounds of an episode's sandbox (local provider); None takes the
    server's."""

    __schema__: ClassVar[str] = "Limits"
    pids: Optional[int] = None
    memory_bytes: Optional[int] = None
    cpu_weight: Optional[int] = None
    shm_bytes: Optional[int] = None
    disk_bytes: Optional[int] = None


# --- checkpoints ------------------------------------------------------------


@dataclass
class ClockFix:
    """What a resume in place did to the guest's wall clock."""

    __schema__: ClassVar[str] = "EpisodeFigures.clock"
    policy: Optional[ClockPolicy] = None
    uptime: float = 0.0
    before: float = 0.0
    after: float = 0.0
    step_s: float = 0.0
    extra: dict[str, Any] = _extra()


@dataclass
class EpisodeFigures:
    """One episode's part of a checkpoint, a restore or a branch."""

    __schema__: ClassVar[str] = "EpisodeFigures"
    episode: str
    finished: bool = False
    snapshot: str = ""
    pause_s: float = 0.0
    snapshot_s: float = 0.0
    bytes: int = 0
    new_bytes: int = 0
    resume: Optional[Literal["in_place", "relaunch", "none"]] = None
    resume_why: str = ""
    clock: Optional[ClockFix] = None
    reward: Optional[int] = None
    excluded: bool = False
    reason: str = ""
    extra: dict[str, Any] = _extra()


@dataclass
class CheckpointResult:
    """The answer to a checkpoint or a branch."""

    __schema__: ClassVar[str] = "CheckpointResult"
    checkpoint: str
    episodes: list[EpisodeFigures]
    phases: dict[str, float]
    seconds: float
    continue_error: str = ""  # committed, but an episode could not be continued after it
    # on a node of a cluster: every node's share (episodes are this node's)
    shares: list[CheckpointShare] = field(default_factory=list)
    extra: dict[str, Any] = _extra()


@dataclass
class CheckpointShare:
    """One node's share of a checkpoint over several nodes."""

    __schema__: ClassVar[str] = "CheckpointShare"
    node: str
    epoch: int  # the node's membership the share belongs to
    state: ShareState
    records: int  # the records it put, once prepared
    live: bool  # the node's lease was live when asked
    error: str = ""
    extra: dict[str, Any] = _extra()


@dataclass
class RestoreResult:
    """The answer to a restore: how each episode resumed; on a node of a
    cluster, this node's episodes, and the restore over every node with
    each node's share."""

    __schema__: ClassVar[str] = "RestoreResult"
    checkpoint: str
    episodes: list[EpisodeFigures]
    phases: dict[str, float]
    seconds: float
    restore: Optional[Restore] = None  # on a node of a cluster
    shares: list[RestoreShare] = field(default_factory=list)  # on a node of a cluster
    # on a node of a cluster: the restore went, but some episodes are not
    # continued yet (their node stopped after it went; it continues them
    # when it starts again)
    continue_error: str = ""
    extra: dict[str, Any] = _extra()


@dataclass
class Restore:
    """A restore over several nodes: all or nothing across them."""

    __schema__: ClassVar[str] = "Restore"
    id: str
    checkpoint: str
    node: str  # the node that began it
    # pending while forks are made ready; go once every node's are;
    # aborted when any failed (every fork deleted)
    state: RestoreState
    error: str = ""
    extra: dict[str, Any] = _extra()


@dataclass
class RestoreShare:
    """One node's share of a restore."""

    __schema__: ClassVar[str] = "RestoreShare"
    node: str
    epoch: int
    episodes: list[str]  # the episodes it brings back
    state: RestoreShareState
    live: bool
    error: str = ""
    extra: dict[str, Any] = _extra()


@dataclass
class Checkpoint:
    """A checkpoint as listed."""

    __schema__: ClassVar[str] = "Checkpoint"
    id: str
    created: datetime
    state: CheckpointState
    episodes: int
    manifest: Optional[dict[str, Any]] = None
    error: str = ""
    committed: Optional[datetime] = None
    extra: dict[str, Any] = _extra()


@dataclass
class CheckpointRecord:
    """One episode's record in a checkpoint (fields this client does not
    know are kept in ``extra``)."""

    __schema__: ClassVar[str] = "Record"
    schema: int
    episode: str
    provider: str
    sandbox: Optional[dict[str, Any]] = None
    snapshot_id: str = ""
    keeps_processes: bool = False
    pause_seq: int = 0
    pause_mode: str = ""
    pause_confirmed: bool = False
    pause_frozen: bool = False
    identity: Optional[Identity] = None
    pause_wall: float = 0.0
    pause_uptime: float = 0.0
    relay_delivered: int = 0
    relay_position: Optional[int] = None  # the in-place cut; None in older records
    relay_unmatched: bool = False  # the relay did not know its place at the pause: a restore matches instead of cutting
    ledger_head: Optional[str] = None  # the hash of the ledger's entry at the cut
    ledger_tip: Optional[str] = None  # the hash of the ledger's last record at the snapshot; None in older records
    harness_session: str = ""
    attempt: int = 0
    deadline_left_s: float = 0.0
    finished: bool = False
    result: Optional[Verdict] = None
    image: str = ""  # the digest of the image the sandbox ran on
    image_ref: str = ""  # the reference it was pulled as
    extra: dict[str, Any] = _extra()


@dataclass
class CheckpointDetail:
    """A checkpoint and its records (one per episode in so far); on a node
    of a cluster every node's share; and how far it is."""

    __schema__: ClassVar[str] = "CheckpointDetail"
    checkpoint: Checkpoint
    records: list[CheckpointRecord]
    progress: CheckpointProgress
    shares: list[CheckpointShare] = field(default_factory=list)  # on a node of a cluster
    extra: dict[str, Any] = _extra()


@dataclass
class CheckpointProgress:
    """How far a checkpoint is: nodes whose share is finished (one node:
    the checkpoint itself), and records in (one per episode)."""

    __schema__: ClassVar[str] = "CheckpointProgress"
    nodes: int
    nodes_done: int
    records: int
    extra: dict[str, Any] = _extra()


@dataclass
class FreedSnapshot:
    """A snapshot a checkpoint's delete freed."""

    __schema__: ClassVar[str] = "Freed.freed"
    provider: str
    snapshot_id: str
    extra: dict[str, Any] = _extra()


# --- ledgers ------------------------------------------------------------------


@dataclass
class Tokens:
    """The token ids and logprobs of one call, as the model server gave
    them (vLLM's and SGLang's extensions)."""

    __schema__: ClassVar[str] = "Tokens"
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per completion token
    extra: dict[str, Any] = _extra()


@dataclass
class LedgerEntry:
    """One model call of a ledger."""

    __schema__: ClassVar[str] = "LedgerEntry"
    seq: int  # 1-based position in the logical ledger
    call_id: str  # "EPISODE/N", the same when the call is issued again
    attempt: int  # the episode's attempt that made it
    parent: str  # the hash of the record before it in the file
    request: Optional[Any]  # the request body as the model server got it (None with bodies=False)
    response: Optional[Any]  # the whole response (None with bodies=False)
    started: datetime
    finished: datetime
    hash: str
    usage: Any = None  # the response's usage, when it had one
    tokens: Optional[Tokens] = None  # when the model server gave them
    boundary: bool = False  # the first entry after a relaunch match: training masks it
    # delivered, abandoned, pending or (dropped by a cut before it was
    # settled) undelivered
    disposition: Optional[Disposition] = None
    extra: dict[str, Any] = _extra()


@dataclass
class LedgerEvent:
    """A cut, a broken mark or a branch, with the file's line that holds
    it."""

    __schema__: ClassVar[str] = "LedgerEvent"
    line: int
    kind: LedgerEventKind
    to: int  # cut, branch: the new logical length; broken: the length then
    from_: int = field(metadata={"json": "from"})  # the logical length before
    reason: str
    at: datetime
    boundary: bool = False  # a cut by a relaunch match: the next entry is a boundary
    # a branch: the hash of the record whose history the ledger went back
    # to (a checkpoint's ledger tip)
    from_record: str = ""
    extra: dict[str, Any] = _extra()


@dataclass
class Ledger:
    """An episode's ledger (GET /v1/episodes/{id}/ledger; ``stasis ledger
    show --json``): the logical ledger, what a trainer batches, is
    ``entries`` (one page of it, or the whole of it from Client.ledger)."""

    __schema__: ClassVar[str] = "Ledger"
    path: str  # the ledger file on the server
    episode: str
    format: int  # the file's format (0: no file yet)
    entries: list[LedgerEntry]  # this page of the logical ledger
    dropped: list[LedgerEntry]  # the entries cuts dropped, in file order
    events: list[LedgerEvent]  # cuts and broken marks, in file order
    total: int  # entry records in the file, cut ones included
    broken: bool  # the history cannot be trusted: do not train on it
    live: int  # the logical ledger's whole length
    more: bool  # entries remain past this page: ask again with after = the last seq
    reason: str = ""  # why it is broken
    torn_bytes: int = 0  # an unfinished last append, ignored
    extra: dict[str, Any] = _extra()

    @property
    def token_count(self) -> int:
        """Completion tokens over the entries."""
        return sum(len(e.tokens.completion_token_ids) for e in self.entries if e.tokens)

    def completion_token_ids(self) -> list[int]:
        """The completion token ids of every entry, in order."""
        return [t for e in self.entries if e.tokens for t in e.tokens.completion_token_ids]

    def logprobs(self) -> list[float]:
        """The completion logprobs of every entry, in order."""
        return [x for e in self.entries if e.tokens for x in e.tokens.logprobs]


@dataclass
class LedgerProblem:
    """The first bad record of a ledger file."""

    __schema__: ClassVar[str] = "LedgerProblem"
    line: int
    what: str
    seq: int = 0  # the entry's seq, when the line is an entry that parsed
    kind: str = ""  # the record's kind, when it parsed
    extra: dict[str, Any] = _extra()

    def __str__(self) -> str:
        where = f" (seq {self.seq})" if self.seq > 0 else (f" ({self.kind})" if self.kind else "")
        return f"line {self.line}{where}: {self.what}"


@dataclass
class LedgerReport:
    """What a walk of a whole ledger file found (GET
    /v1/episodes/{id}/ledger/verify; ``stasis ledger verify --json``)."""

    __schema__: ClassVar[str] = "LedgerReport"
    path: str
    episode: str
    format: int
    ok: bool  # every record is intact
    records: int  # lines, the header included (up to bad)
    entries: int  # entry records, cut ones included
    live: int  # the logical length
    cuts: int
    broken: bool
    head: str  # the last good record's hash
    delivered: int
    abandoned: int
    pending: int
    undelivered: int  # dropped by a cut before being settled
    bad: Optional[LedgerProblem] = None  # the first bad record, when not ok
    broken_reason: str = ""
    torn_bytes: int = 0
    extra: dict[str, Any] = _extra()


# --- tasks ---------------------------------------------------------------------


@dataclass
class TaskSummary:
    """A task the server starts episodes on (GET /v1/tasks)."""

    __schema__: ClassVar[str] = "TaskSummary"
    id: str  # what a start's task names
    budget_s: float  # the harness's time budget in seconds
    fail_to_pass: int  # how many tests must go from failing to passing
    pass_to_pass: int  # how many tests must keep passing
    language: str = ""
    title: str = ""
    image: str = ""  # the task's own image reference, if it has one
    extra: dict[str, Any] = _extra()


# --- request bodies -------------------------------------------------------------


@dataclass
class StartRequest:
    """The body of a start (POST /v1/episodes)."""

    __schema__: ClassVar[str] = "StartRequest"
    task: str
    harness: Harness
    id: Optional[str] = None
    provider: Optional[Provider] = None
    pause_mode: Optional[PauseMode] = None
    deadline_s: Optional[float] = None
    limits: Optional[Limits] = None
    image: Optional[str] = None


@dataclass
class CheckpointRequest:
    """The body of a checkpoint (POST /v1/checkpoints)."""

    __schema__: ClassVar[str] = "CheckpointRequest"
    id: Optional[str] = None
    stragglers: Optional[Stragglers] = None


@dataclass
class RestoreRequest:
    """The optional body of a restore (POST /v1/checkpoints/{id}/restore):
    a scoped restore. ``episodes`` are the only episodes of the checkpoint
    to bring back (at least one); a retired one named comes back as its
    next attempt."""

    __schema__: ClassVar[str] = "RestoreRequest"
    episodes: Optional[list[str]] = None


@dataclass
class BranchRequest:
    """The body of a branch (POST /v1/checkpoints/{id}/branch)."""

    __schema__: ClassVar[str] = "BranchRequest"
    episode: str
    copies: Optional[int] = None
    ids: Optional[list[str]] = None


# --- decoding and encoding ----------------------------------------------------

_TIME_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?([Zz]|[+-]\d{2}:?\d{2})?$")


def parse_time(s: str) -> datetime:
    """Parse an RFC 3339 time as Go writes it (nanoseconds, Z), on any
    Python from 3.10 (whose fromisoformat takes neither)."""
    m = _TIME_RE.match(s)
    if not m:
        raise ValueError(f"not an RFC 3339 time: {s!r}")
    date, hh, mm, ss, frac, tz = m.groups()
    y, mo, d = (int(x) for x in date.split("-"))
    micro = int((frac or "0")[:6].ljust(6, "0"))
    tzinfo: Optional[timezone] = None
    if tz:
        if tz in ("Z", "z"):
            tzinfo = timezone.utc
        else:
            sign = -1 if tz[0] == "-" else 1
            digits = tz[1:].replace(":", "")
            tzinfo = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    return datetime(y, mo, d, int(hh), int(mm), int(ss), micro, tzinfo=tzinfo)


_hints_cache: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (cached)."""
    h = _hints_cache.get(cls)
    if h is None:
        mod = sys.modules[cls.__module__]
        h = typing.get_type_hints(cls, globalns=vars(mod))
        _hints_cache[cls] = h
    return h


def json_name(f: dataclasses.Field) -> str:
    """The JSON property a dataclass field stands for: its name, unless its
    metadata gives another (``metadata={"json": "from"}``)."""
    return f.metadata.get("json", f.name)


def _is_union(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Union:
        return True
    ut = getattr(__import__("types"), "UnionType", None)
    return ut is not None and origin is ut


def decode(tp: Any, value: Any) -> Any:
    """Turn decoded JSON into tp (a dataclass, a list, a dict, a scalar),
    following the annotations. Unknown object keys go to ``extra``."""
    if tp is Any:
        return value
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        inner = args[0] if len(args) == 1 else Any
        # Go writes an unset enum as "": that is no value, not a member.
        if value == "" and typing.get_origin(inner) is Literal and "" not in typing.get_args(inner):
            return None
        return decode(inner, value)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return [decode(item, v) for v in (value or [])]
    if origin is dict:
        args = typing.get_args(tp)
        vt = args[1] if len(args) == 2 else Any
        return {k: decode(vt, v) for k, v in (value or {}).items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__}: want a JSON object, got {type(value).__name__}")
        hints = type_hints(tp)
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        names = {json_name(f): f.name for f in dataclasses.fields(tp) if not f.metadata.get("extra")}
        for k, v in value.items():
            name = names.get(k)
            if name is not None:
                kw[name] = decode(hints[name], v)
            else:
                extra[k] = v
        for f in dataclasses.fields(tp):
            if f.metadata.get("extra"):
                kw[f.name] = extra
            elif f.name not in kw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                # A required property the server left out: the zero value
                # of its type, rather than a TypeError in a trainer's loop.
                kw[f.name] = _zero(hints[f.name])
        return tp(**kw)
    if tp is datetime:
        return parse_time(value) if isinstance(value, str) else value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _zero(tp: Any) -> Any:
    if _is_union(tp):
        return None
    origin = typing.get_origin(tp)
    if origin is list:
        return []
    if origin is dict:
        return {}
    return {int: 0, float: 0.0, str: "", bool: False}.get(tp)


def encode(value: Any) -> Any:
    """Turn a request dataclass (or a plain value) into JSON-ready data,
    leaving out fields that are None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.metadata.get("extra"):
                out.update(v)
                continue
            if v is None:
                continue
            out[json_name(f)] = encode(v)
        return out
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, datetime):
        return value.isoformat()
    return value
