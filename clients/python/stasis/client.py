"""The client of the stasis environment server (``stasis serve``).

One method per operation of ``internal/control/openapi/server.json`` (the table
``OPERATIONS`` names them; a test holds it to the document), answers as
typed dataclasses (``stasis.models``), errors as exceptions
(``stasis.errors``). Standard library only.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from .errors import APIError, StasisError, TransportError, error_for
from .models import (
    BranchRequest,
    Checkpoint,
    CheckpointDetail,
    CheckpointRequest,
    CheckpointResult,
    Episode,
    FreedSnapshot,
    Ledger,
    LedgerReport,
    Limits,
    RestoreRequest,
    RestoreResult,
    StartRequest,
    TaskSummary,
    VerifyResult,
    decode,
    encode,
)

__all__ = ["Client", "Operation", "OPERATIONS", "TOKEN_ENV", "URL_ENV"]

TOKEN_ENV = "STASIS_API_TOKEN"
"""The environment variable the bearer token is read from when no token is
given."""

URL_ENV = "STASIS_URL"
"""The environment variable the server's address is read from when no url is
given."""


@dataclass(frozen=True)
class Operation:
    """One operation of the API, as this client speaks it."""

    operation_id: str
    method: str
    path: str
    status: int  # the success status
    python: str  # the Client method
    idempotent: bool = False  # retried on a failure that may be transient
    auth: bool = True  # sends the bearer token
    body: Optional[type] = None  # the request body's dataclass
    body_required: bool = False
    query: tuple[str, ...] = ()
    response: Any = None  # the dataclass of the answer, or str (text), or dict (JSON as is)
    unwrap: Optional[str] = None  # the answer is {unwrap: [response, ...]}
    slow: bool = False  # answers once the work is done: the long timeout


OPERATIONS: dict[str, Operation] = {
    op.operation_id: op
    for op in [
        Operation("startEpisode", "POST", "/v1/episodes", 201, "start_episode", body=StartRequest, body_required=True, response=Episode, slow=True),
        Operation("listEpisodes", "GET", "/v1/episodes", 200, "list_episodes", idempotent=True, query=("state", "task", "harness"), response=Episode, unwrap="episodes"),
        Operation("getEpisode", "GET", "/v1/episodes/{id}", 200, "get_episode", idempotent=True, response=Episode),
        # Verify captures once (a later verify answers the recorded verdict)
        # and retire deletes the sandbox once: both may be sent again.
        Operation("verifyEpisode", "POST", "/v1/episodes/{id}/verify", 200, "verify_episode", idempotent=True, response=VerifyResult, slow=True),
        Operation("retireEpisode", "POST", "/v1/episodes/{id}/retire", 200, "retire_episode", idempotent=True, response=Episode, slow=True),
        Operation("getLedger", "GET", "/v1/episodes/{id}/ledger", 200, "get_ledger", idempotent=True, query=("after", "limit", "bodies"), response=Ledger),
        Operation("verifyLedger", "GET", "/v1/episodes/{id}/ledger/verify", 200, "verify_ledger", idempotent=True, response=LedgerReport),
        Operation("createCheckpoint", "POST", "/v1/checkpoints", 201, "create_checkpoint", body=CheckpointRequest, response=CheckpointResult, slow=True),
        Operation("listCheckpoints", "GET", "/v1/checkpoints", 200, "list_checkpoints", idempotent=True, query=("state", "limit"), response=Checkpoint, unwrap="checkpoints"),
        Operation("getCheckpoint", "GET", "/v1/checkpoints/{id}", 200, "get_checkpoint", idempotent=True, response=CheckpointDetail),
        Operation("deleteCheckpoint", "DELETE", "/v1/checkpoints/{id}", 200, "delete_checkpoint", response=FreedSnapshot, unwrap="freed", slow=True),
        Operation("restoreCheckpoint", "POST", "/v1/checkpoints/{id}/restore", 200, "restore_checkpoint", body=RestoreRequest, response=RestoreResult, slow=True),
        Operation("branchCheckpoint", "POST", "/v1/checkpoints/{id}/branch", 201, "branch_checkpoint", body=BranchRequest, body_required=True, response=CheckpointResult, slow=True),
        Operation("listTasks", "GET", "/v1/tasks", 200, "list_tasks", idempotent=True, response=TaskSummary, unwrap="tasks"),
        Operation("metrics", "GET", "/metrics", 200, "metrics", idempotent=True, response=str),
        Operation("healthz", "GET", "/healthz", 200, "healthz", idempotent=True, auth=False, response=str),
        Operation("openapi", "GET", "/openapi.json", 200, "openapi", idempotent=True, response=dict),
    ]
}

# Statuses worth sending an idempotent call again for.
RETRY_STATUSES = frozenset({429, 502, 503, 504})


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, sock_path: str, host: str, **kw: Any):
        super().__init__(host, **kw)
        self._sock_path = sock_path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:  # type: ignore[attr-defined]
            s.settimeout(self.timeout)
        try:
            s.connect(self._sock_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


class _UnixHandler(urllib.request.HTTPHandler):
    """http:// requests, sent on a unix socket."""

    def __init__(self, sock_path: str):
        super().__init__()
        self._sock_path = sock_path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kw: _UnixConnection(self._sock_path, host, **kw), req)


def _parse_address(url: str) -> tuple[str, Optional[str]]:
    """The base URL and, for unix:PATH, the socket's path."""
    url = url.strip()
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"address {url!r}: unix: needs a path, e.g. unix:/run/stasis/api.sock")
        # The server answers a unix socket's requests whatever the Host.
        return "http://localhost", path
    if "://" not in url:
        url = "http://" + url  # host:port, as `stasis serve` prints it
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"address {url!r}: give http://HOST:PORT, https://HOST:PORT, HOST:PORT or unix:/PATH")
    return url.rstrip("/"), None


def _query_value(v: Any) -> str:
    """A query parameter as the server parses it (a bool as true/false)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _loopback(base: str) -> bool:
    host = urllib.parse.urlsplit(base).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


class Client:
    """A client of one stasis server.

    ``url`` is where it serves: ``http://127.0.0.1:8080``, ``127.0.0.1:8080``
    (as ``stasis serve`` prints it), ``https://...`` or ``unix:/path/api.sock``;
    by default ``$STASIS_URL``. ``token`` is the bearer token of a server
    started with ``--api-token-file`` (by default ``$STASIS_API_TOKEN``; none
    is sent when there is neither). ``timeout`` bounds each request in
    seconds; the operations that answer only once their work is done
    (start, verify, retire, checkpoint, restore, branch, delete) get
    ``slow_timeout``. An idempotent call (every GET, verify, retire) that
    gets no answer or a 429/502/503/504 is sent again up to ``retries``
    times, with exponential backoff from ``backoff`` seconds; the others
    are sent once. ``ssl_context`` is for TLS (a CA, a client certificate).
    """

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        timeout: float = 60.0,
        slow_timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.2,
        ssl_context: Optional[ssl.SSLContext] = None,
        user_agent: str = "stasis-python/0.1",
    ):
        if url is None:
            url = os.environ.get(URL_ENV)
            if not url:
                raise ValueError(f"no server address: give Client(url) or set ${URL_ENV}")
        if retries < 0:
            raise ValueError("retries must be 0 or more")
        self.url = url
        self.base, self.socket_path = _parse_address(url)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.timeout, self.slow_timeout = timeout, slow_timeout
        self.retries, self.backoff = retries, backoff
        self.user_agent = user_agent
        handlers: list[Any] = []
        if self.socket_path is not None:
            handlers.append(_UnixHandler(self.socket_path))
        if self.socket_path is not None or _loopback(self.base):
            handlers.append(urllib.request.ProxyHandler({}))
        if ssl_context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=ssl_context))
        self._opener = urllib.request.build_opener(*handlers)

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # --- transport ---------------------------------------------------------

    def _call(
        self,
        operation_id: str,
        *,
        params: Optional[dict[str, str]] = None,
        query: Optional[dict[str, Any]] = None,
        body: Any = None,
        timeout: Optional[float] = None,
    ) -> Any:
        op = OPERATIONS[operation_id]
        path = op.path
        for k, v in (params or {}).items():
            if not isinstance(v, str) or not v:
                raise ValueError(f"{op.python}: {k} must be a non-empty string, got {v!r}")
            path = path.replace("{" + k + "}", urllib.parse.quote(v, safe=""))
        q = {k: _query_value(v) for k, v in (query or {}).items() if v is not None}
        unknown = set(q) - set(op.query)
        if unknown:
            raise ValueError(f"{op.python}: unknown query parameters {sorted(unknown)}")
        url = self.base + path + ("?" + urllib.parse.urlencode(q) if q else "")
        headers = {"Accept": "application/json" if op.response not in (str,) else "text/plain", "User-Agent": self.user_agent}
        data: Optional[bytes] = None
        if op.method != "GET":
            # Every POST (and DELETE) is sent as JSON, with a body or without.
            headers["Content-Type"] = "application/json"
            data = b"" if body is None else json.dumps(encode(body), separators=(",", ":")).encode()
        if op.auth and self.token:
            headers["Authorization"] = "Bearer " + self.token
        if timeout is None:
            timeout = self.slow_timeout if op.slow else self.timeout
        tries = 1 + (self.retries if op.idempotent else 0)
        for i in range(tries):
            last = i == tries - 1
            try:
                status, ctype, raw = self._send(op.method, url, data, headers, timeout)
            except APIError as e:
                if last or e.status not in RETRY_STATUSES:
                    raise
                self._pause(i)
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                if last:
                    cause = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
                    raise TransportError(op.method, path, cause, retried=i) from e
                self._pause(i)
                continue
            return self._answer(op, path, status, ctype, raw)
        raise AssertionError("unreachable")

    def _pause(self, i: int) -> None:
        time.sleep(min(5.0, self.backoff * (2**i)) * (0.5 + random.random() / 2))

    def _send(self, method: str, url: str, data: Optional[bytes], headers: dict[str, str], timeout: float) -> tuple[int, str, bytes]:
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read() or b""
            typ, msg = "", raw.decode("utf-8", "replace").strip()
            try:
                doc = json.loads(raw)
                err = doc.get("error") if isinstance(doc, dict) else None
                if isinstance(err, dict):
                    typ, msg = str(err.get("type", "")), str(err.get("message", ""))
            except ValueError:
                pass
            path = urllib.parse.urlsplit(url).path
            raise error_for(e.code, typ, msg or (e.reason or ""), method=method, path=path, www_authenticate=e.headers.get("WWW-Authenticate") if e.headers else None) from None

    def _answer(self, op: Operation, path: str, status: int, ctype: str, raw: bytes) -> Any:
        if op.response is str:
            return raw.decode("utf-8", "replace")
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise APIError(status, "", f"the answer is not JSON ({ctype}): {raw[:200]!r}", method=op.method, path=path) from e
        if op.response is dict:
            return doc
        if op.unwrap is not None:
            return [decode(op.response, x) for x in (doc.get(op.unwrap) or [])]
        return decode(op.response, doc)

    # --- episodes ------------------------------------------------------------

    def start_episode(
        self,
        task: str,
        harness: str = "mini",
        *,
        id: Optional[str] = None,
        provider: Optional[str] = None,
        pause_mode: Optional[str] = None,
        deadline_s: Optional[float] = None,
        limits: Optional[Limits] = None,
        image: Optional[str] = None,
    ) -> Episode:
        """Start an episode of task with harness (POST /v1/episodes): a
        sandbox with the task's work tree, the harness under its supervisor.
        The id of a retired or lost episode (with its task and harness)
        starts it again as its next attempt. A start asked while a
        checkpoint runs answers once the checkpoint is done. Not retried (a
        second start of an id that runs is a Conflict)."""
        req = StartRequest(task=task, harness=harness, id=id, provider=provider, pause_mode=pause_mode, deadline_s=deadline_s, limits=limits, image=image)  # type: ignore[arg-type]
        return self._call("startEpisode", body=req)

    def list_episodes(self, *, state: Optional[str] = None, task: Optional[str] = None, harness: Optional[str] = None) -> list[Episode]:
        """The episodes, oldest first (GET /v1/episodes); state is running,
        ended, retired or lost."""
        return self._call("listEpisodes", query={"state": state, "task": task, "harness": harness})

    def get_episode(self, id: str) -> Episode:
        """One episode (GET /v1/episodes/{id})."""
        return self._call("getEpisode", params={"id": id})

    def verify_episode(self, id: str) -> VerifyResult:
        """Run the task's tests on an episode whose harness has ended, once
        (POST /v1/episodes/{id}/verify): a later call answers the recorded
        verdict (recorded true). Conflict while the harness runs."""
        return self._call("verifyEpisode", params={"id": id})

    def retire_episode(self, id: str) -> Episode:
        """Delete an episode's sandbox (POST /v1/episodes/{id}/retire); its
        snapshots stay while a checkpoint names them."""
        return self._call("retireEpisode", params={"id": id})

    # --- ledgers -------------------------------------------------------------------

    def get_ledger(self, id: str, *, after: Optional[int] = None, limit: Optional[int] = None, bodies: Optional[bool] = None) -> Ledger:
        """One page of an episode's ledger (GET /v1/episodes/{id}/ledger):
        the entries whose seq is over after (default 0), at most limit of
        them (1 to 10000, the default); bodies=False leaves out each
        entry's request and response (tokens, usage and hashes stay).
        ``more`` says entries remain: ask again with after = the last seq
        (``ledger`` does). An episode with no model call yet has an empty
        ledger; a damaged ledger file is a Conflict (``verify_ledger`` says
        where)."""
        return self._call("getLedger", params={"id": id}, query={"after": after, "limit": limit, "bodies": bodies})

    def verify_ledger(self, id: str) -> LedgerReport:
        """Walk an episode's whole ledger file on the server (GET
        /v1/episodes/{id}/ledger/verify): every hash, parent link and
        sequence number. A damaged file is not an error: ``ok`` is False
        and ``bad`` names its first bad record."""
        return self._call("verifyLedger", params={"id": id})

    # --- checkpoints -------------------------------------------------------------

    def create_checkpoint(self, *, id: Optional[str] = None, stragglers: Optional[str] = None) -> CheckpointResult:
        """Checkpoint every live episode (POST /v1/checkpoints): pause,
        snapshot, record, commit, continue; answers once committed. Not
        retried (a second one with the same id is a Conflict)."""
        body = CheckpointRequest(id=id, stragglers=stragglers)  # type: ignore[arg-type]
        return self._call("createCheckpoint", body=body if (id or stragglers) else None)

    def list_checkpoints(self, *, state: Optional[str] = None, limit: Optional[int] = None) -> list[Checkpoint]:
        """The checkpoints, newest first (GET /v1/checkpoints); state is
        pending, committed or failed; limit 0 (or None) for all."""
        return self._call("listCheckpoints", query={"state": state, "limit": limit})

    def get_checkpoint(self, id: str) -> CheckpointDetail:
        """A checkpoint and its records (GET /v1/checkpoints/{id})."""
        return self._call("getCheckpoint", params={"id": id})

    def delete_checkpoint(self, id: str) -> list[FreedSnapshot]:
        """Delete a committed or failed checkpoint and the snapshots no
        other names (DELETE /v1/checkpoints/{id}); returns those freed."""
        return self._call("deleteCheckpoint", params={"id": id})

    def restore_checkpoint(self, id: str, *, episodes: Optional[Sequence[str]] = None) -> RestoreResult:
        """Restore a committed checkpoint, all or nothing (POST
        /v1/checkpoints/{id}/restore): each episode resumed in place or
        relaunched. Without episodes, every episode of the checkpoint but
        the retired ones (left out, ``excluded``, in result.episodes);
        with them, only those (a scoped restore; the others go on as they
        are), and a retired one named comes back (as its next attempt, or,
        if its harness had ended at the checkpoint, as ended). On a
        node of a cluster the restore spans every live node (result.restore,
        result.shares). Conflict while an episode it brings back is live;
        NotFound for an episode the checkpoint does not hold; an empty
        list is InvalidRequest."""
        if isinstance(episodes, str):
            raise TypeError("restore_checkpoint: episodes is a list of episode ids, not one string")
        body = RestoreRequest(episodes=list(episodes)) if episodes is not None else None
        return self._call("restoreCheckpoint", params={"id": id}, body=body)

    def branch_checkpoint(self, id: str, episode: str, *, copies: Optional[int] = None, ids: Optional[Sequence[str]] = None) -> CheckpointResult:
        """Continue one episode of a committed checkpoint as new episodes,
        each in its own fork (POST /v1/checkpoints/{id}/branch);
        result.episodes names the copies."""
        body = BranchRequest(episode=episode, copies=copies, ids=list(ids) if ids is not None else None)
        return self._call("branchCheckpoint", params={"id": id}, body=body)

    # --- tasks ----------------------------------------------------------------------------

    def list_tasks(self) -> list[TaskSummary]:
        """The tasks this server starts episodes on (GET /v1/tasks)."""
        return self._call("listTasks")

    # --- the server ------------------------------------------------------------------

    def metrics(self) -> str:
        """The server's and the gateway's Prometheus metrics, as text (GET
        /metrics)."""
        return self._call("metrics")

    def healthz(self) -> bool:
        """True when the server and its record store answer (GET /healthz);
        Unavailable (503) otherwise, after the retries."""
        return self._call("healthz").strip() == "ok"

    def openapi(self) -> dict[str, Any]:
        """The server's OpenAPI document (GET /openapi.json)."""
        return self._call("openapi")

    # --- built on the operations ----------------------------------------------------------

    def latest_checkpoint(self, state: str = "committed") -> Optional[Checkpoint]:
        """The newest checkpoint in state (committed by default), or None."""
        cks = self.list_checkpoints(state=state, limit=1)
        return cks[0] if cks else None

    def wait_episodes(self, ids: Optional[Iterable[str]] = None, *, timeout: float = 600.0, poll: float = 0.5) -> list[Episode]:
        """Poll until the harness of every episode named (by default every
        running one) has ended, and return them; TimeoutError after
        timeout seconds."""
        want = set(ids) if ids is not None else None
        deadline = time.monotonic() + timeout
        while True:
            eps = [e for e in self.list_episodes() if (e.id in want if want is not None else e.state == "running")]
            if want is not None and len(eps) < len(want):
                missing = want - {e.id for e in eps}
                raise ValueError(f"no such episodes: {sorted(missing)}")
            if all(e.harness_ended for e in eps):
                return eps
            if time.monotonic() >= deadline:
                running = sorted(e.id for e in eps if not e.harness_ended)
                raise TimeoutError(f"episodes still running after {timeout}s: {running}")
            time.sleep(poll)

    def ledger(self, id: str, *, bodies: bool = True) -> Ledger:
        """An episode's whole logical ledger in one Ledger: every model call
        its harness acted on, in order, with its token ids and logprobs,
        read page by page (get_ledger with after, while ``more``).
        bodies=False leaves out each entry's request and response. Should a
        cut change the ledger between two pages, it is read again from the
        start."""
        for _ in range(5):
            page = self.get_ledger(id, bodies=bodies)
            entries = list(page.entries)
            while page.more:
                if not page.entries:
                    raise StasisError(f"GET /v1/episodes/{id}/ledger: more entries remain, says the server, yet its page is empty")
                nxt = self.get_ledger(id, after=entries[-1].seq, bodies=bodies)
                if len(nxt.events) != len(page.events):
                    break  # a cut (or broken mark) since the last page
                page = nxt
                entries += page.entries
            else:
                if [e.seq for e in entries] == list(range(1, len(entries) + 1)):
                    page.entries, page.more = entries, False
                    return page
        raise StasisError(f"GET /v1/episodes/{id}/ledger: the ledger was cut between its pages five times over: try again")
