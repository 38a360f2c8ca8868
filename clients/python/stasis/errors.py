"""The errors the client raises.

Every answer of the server that is not a success becomes an ``APIError``
(a subclass per error type of the API: ``NotFound``, ``Conflict``, ...)
with the HTTP ``status``, the error ``type`` and the server's ``message``.
A request that got no answer (refused, reset, timed out) is a
``TransportError``.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "StasisError",
    "TransportError",
    "APIError",
    "InvalidRequest",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "MethodNotAllowed",
    "Conflict",
    "TooLarge",
    "UnsupportedMediaType",
    "Misdirected",
    "InternalError",
    "NodeUnreachable",
    "Unavailable",
    "ERROR_TYPES",
    "error_for",
]


class StasisError(Exception):
    """The base of every error of this package."""


class TransportError(StasisError):
    """The request got no answer: the server is not there, the connection
    broke, or the timeout passed. ``retried`` is how many times it was sent
    again before giving up (0 for a call that is not retried)."""

    def __init__(self, method: str, path: str, cause: BaseException, retried: int = 0):
        self.method, self.path, self.cause, self.retried = method, path, cause, retried
        again = f" (after {retried} retries)" if retried else ""
        super().__init__(f"{method} {path}: no answer{again}: {cause}")


class APIError(StasisError):
    """The server answered with an error: ``status`` (HTTP), ``type`` (the
    API's error type, e.g. "conflict") and ``message``."""

    status: int = 0
    type: str = ""

    def __init__(self, status: int, type: str, message: str, method: str = "", path: str = "", www_authenticate: Optional[str] = None):
        self.status, self.type, self.message = status, type, message
        self.method, self.path = method, path
        self.www_authenticate = www_authenticate
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}{status} {type}: {message}")


class InvalidRequest(APIError):
    """400: a malformed body, an unknown field or value."""


class Unauthorized(APIError):
    """401: no bearer token, or one the server does not accept."""


class Forbidden(APIError):
    """403: a request the server takes for a browser's cross-origin one."""


class NotFound(APIError):
    """404: an unknown episode or checkpoint, or a path no operation
    serves."""


class MethodNotAllowed(APIError):
    """405: a method the path does not serve (the server's Allow header
    names those it does)."""


class Conflict(APIError):
    """409: the id exists, or the episode or checkpoint is in the wrong
    state for the operation (nothing was changed), or an episode's ledger
    file is damaged (``verify_ledger`` says where)."""


class Expired(APIError):
    """410: the episode's sandbox is past its expiry."""


class TooLarge(APIError):
    """413: the body is over 1 MiB."""


class UnsupportedMediaType(APIError):
    """415: a POST not sent as application/json."""


class Misdirected(APIError):
    """421: a Host header the server does not answer to."""


class InternalError(APIError):
    """500: the operation failed on the server."""


class Unsupported(APIError):
    """501: the server's sandbox provider cannot do it."""


class NodeUnreachable(APIError):
    """502: on a node of a cluster, the node that drives the episode did not
    answer the request this one forwarded to it; ask again (it may have
    taken effect), or once that node's lease has run out."""


class Unavailable(APIError):
    """503: the server is shutting down, or a service it needs (its record
    store, a hosted sandbox provider) is unreachable or refusing load; try
    again later."""


class Timeout(APIError):
    """504: the operation did not finish in time; it may have taken
    effect."""


# The error types of the API (the Error schema) and their statuses.
ERROR_TYPES: dict[str, tuple[int, type[APIError]]] = {
    "invalid_request": (400, InvalidRequest),
    "unauthorized": (401, Unauthorized),
    "forbidden": (403, Forbidden),
    "not_found": (404, NotFound),
    "method_not_allowed": (405, MethodNotAllowed),
    "conflict": (409, Conflict),
    "expired": (410, Expired),
    "too_large": (413, TooLarge),
    "unsupported_media_type": (415, UnsupportedMediaType),
    "misdirected": (421, Misdirected),
    "internal": (500, InternalError),
    "unsupported": (501, Unsupported),
    "node_unreachable": (502, NodeUnreachable),
    "unavailable": (503, Unavailable),
    "timeout": (504, Timeout),
}

for _t, (_s, _c) in ERROR_TYPES.items():
    _c.status, _c.type = _s, _t

_BY_STATUS = {s: c for s, c in ERROR_TYPES.values()}


def error_for(status: int, type: str, message: str, **kw) -> APIError:
    """The exception for an error answer: by its type, else by its status."""
    cls = ERROR_TYPES.get(type, (0, None))[1] or _BY_STATUS.get(status, APIError)
    return cls(status, type, message, **kw)
