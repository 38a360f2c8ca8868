"""A Python client of the stasis environment server (``stasis serve``).

    import stasis

    c = stasis.Client("unix:/var/lib/stasis/api.sock")
    ep = c.start_episode("py-ini-value-with-equals", "mini")
    ck = c.create_checkpoint()
    ...
    c.wait_episodes([ep.id])
    reward = c.verify_episode(ep.id).verdict.reward
    for e in c.ledger(ep.id).entries:   # the whole logical ledger, paged
        e.tokens.completion_token_ids, e.tokens.logprobs

Standard library only; Python 3.10 or later. ``stasis.aio.AsyncClient`` is
the same client for asyncio; ``stasis.local.LocalServer`` runs a server on
this machine (development, tests, the examples).
"""

from .aio import AsyncClient
from .client import OPERATIONS, TOKEN_ENV, URL_ENV, Client, Operation
from .errors import (
    ERROR_TYPES,
    APIError,
    Conflict,
    Expired,
    Forbidden,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    Misdirected,
    NodeUnreachable,
    NotFound,
    StasisError,
    Timeout,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
    Unsupported,
    UnsupportedMediaType,
)
from .models import (
    BranchRequest,
    Checkpoint,
    CheckpointDetail,
    CheckpointProgress,
    CheckpointRecord,
    CheckpointRequest,
    CheckpointResult,
    CheckpointShare,
    ClockFix,
    Episode,
    EpisodeFigures,
    FreedSnapshot,
    Identity,
    Ledger,
    LedgerEntry,
    LedgerEvent,
    LedgerProblem,
    LedgerReport,
    Limits,
    Receipt,
    Restore,
    RestoreRequest,
    RestoreResult,
    RestoreShare,
    StartRequest,
    SupervisorStatus,
    TaskSummary,
    Tokens,
    Verdict,
    VerifyResult,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Client",
    "Operation",
    "OPERATIONS",
    "TOKEN_ENV",
    "URL_ENV",
    "ERROR_TYPES",
    "APIError",
    "Conflict",
    "Expired",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "MethodNotAllowed",
    "Misdirected",
    "NodeUnreachable",
    "NotFound",
    "StasisError",
    "Timeout",
    "TooLarge",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
    "UnsupportedMediaType",
    "Ledger",
    "LedgerEntry",
    "LedgerEvent",
    "LedgerProblem",
    "LedgerReport",
    "Tokens",
    "TaskSummary",
    "BranchRequest",
    "Checkpoint",
    "CheckpointDetail",
    "CheckpointProgress",
    "CheckpointRecord",
    "CheckpointRequest",
    "CheckpointResult",
    "CheckpointShare",
    "ClockFix",
    "Episode",
    "EpisodeFigures",
    "FreedSnapshot",
    "Identity",
    "Limits",
    "Receipt",
    "Restore",
    "RestoreRequest",
    "RestoreResult",
    "RestoreShare",
    "StartRequest",
    "SupervisorStatus",
    "Verdict",
    "VerifyResult",
]
