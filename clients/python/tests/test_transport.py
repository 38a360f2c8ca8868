"""Retries, timeouts, errors and the token, against a small HTTP server in
this process that answers as told (a real server will not fail on demand;
tests/test_server.py speaks to the real one)."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import unittest
from unittest import mock

import support  # noqa: F401  (the import path)
import stasis


class Scripted(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script: list[tuple[int, str, bytes, float]] = []  # status, content type, body, delay
        self.seen: list[tuple[str, str, dict, bytes]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.server_address[1]


class Handler(http.server.BaseHTTPRequestHandler):
    server: Scripted

    def log_message(self, *a):
        pass

    def _any(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        with self.server.lock:
            self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            status, ctype, out, delay = self.server.script.pop(0) if self.server.script else (200, "application/json", b"{}", 0)
        if delay:
            time.sleep(delay)
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(out)))
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="stasis"')
            self.end_headers()
            self.wfile.write(out)
        except OSError:
            pass  # the client gave up

    do_GET = do_POST = do_DELETE = _any


def err(status: int, typ: str, msg: str) -> tuple[int, str, bytes, float]:
    return status, "application/json", json.dumps({"error": {"type": typ, "message": msg}}).encode(), 0


class TransportTest(unittest.TestCase):
    def setUp(self):
        self.srv = Scripted()
        self.t = threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.t.start()

    def tearDown(self):
        self.srv.shutdown()
        self.srv.server_close()
        self.t.join(10)
        self.assertFalse(self.t.is_alive())

    def client(self, **kw):
        kw.setdefault("backoff", 0.01)
        return stasis.Client(self.srv.url, **kw)

    def test_errors_are_typed(self):
        cases = [
            (400, "invalid_request", stasis.InvalidRequest),
            (401, "unauthorized", stasis.Unauthorized),
            (403, "forbidden", stasis.Forbidden),
            (404, "not_found", stasis.NotFound),
            (409, "conflict", stasis.Conflict),
            (413, "too_large", stasis.TooLarge),
            (415, "unsupported_media_type", stasis.UnsupportedMediaType),
            (421, "misdirected", stasis.Misdirected),
            (500, "internal", stasis.InternalError),
        ]
        c = self.client(retries=0)
        for status, typ, cls in cases:
            with self.subTest(typ=typ):
                self.srv.script = [err(status, typ, f"it is {typ}")]
                with self.assertRaises(cls) as cm:
                    c.get_episode("ep-1")
                e = cm.exception
                self.assertIsInstance(e, stasis.APIError)
                self.assertEqual((e.status, e.type, e.message), (status, typ, f"it is {typ}"))
                self.assertEqual((e.method, e.path), ("GET", "/v1/episodes/ep-1"))
        self.assertEqual(len(self.srv.seen), len(cases))

    def test_unknown_type_goes_by_status(self):
        self.srv.script = [err(409, "something_new", "x")]
        with self.assertRaises(stasis.Conflict) as cm:
            self.client(retries=0).get_checkpoint("c")
        self.assertEqual(cm.exception.type, "something_new")

    def test_text_error(self):
        self.srv.script = [(503, "text/plain", b"record store unreachable\n", 0)]
        with self.assertRaises(stasis.Unavailable) as cm:
            self.client(retries=0).healthz()
        self.assertEqual(cm.exception.message, "record store unreachable")

    def test_idempotent_calls_are_retried(self):
        self.srv.script = [err(503, "unavailable", "shutting down"), err(502, "", "bad gateway"), (200, "application/json", b'{"episodes": []}', 0)]
        self.assertEqual(self.client(retries=3).list_episodes(), [])
        self.assertEqual(len(self.srv.seen), 3)

    def test_retries_are_bounded(self):
        self.srv.script = [err(503, "unavailable", "down")] * 10
        with self.assertRaises(stasis.Unavailable):
            self.client(retries=2).list_checkpoints()
        self.assertEqual(len(self.srv.seen), 3)

    def test_other_calls_are_not_retried(self):
        for call in (lambda c: c.create_checkpoint(id="ck-1"), lambda c: c.start_episode("t", "mini"), lambda c: c.restore_checkpoint("ck-1"), lambda c: c.delete_checkpoint("ck-1"), lambda c: c.branch_checkpoint("ck-1", "ep-1")):
            self.srv.seen.clear()
            self.srv.script = [err(503, "unavailable", "down")] * 5
            with self.assertRaises(stasis.Unavailable):
                call(self.client(retries=3))
            self.assertEqual(len(self.srv.seen), 1)

    def test_errors_that_are_not_transient_are_not_retried(self):
        self.srv.script = [err(404, "not_found", "no")] * 5
        with self.assertRaises(stasis.NotFound):
            self.client(retries=3).get_episode("x")
        self.assertEqual(len(self.srv.seen), 1)

    def test_timeout(self):
        self.srv.script = [(200, "application/json", b"{}", 1.0)] * 3
        t0 = time.monotonic()
        with self.assertRaises(stasis.TransportError) as cm:
            self.client(retries=1, timeout=0.2).get_episode("slow")
        self.assertLess(time.monotonic() - t0, 1.5)
        self.assertEqual(cm.exception.retried, 1)
        self.assertEqual(len(self.srv.seen), 2)

    def test_no_server(self):
        self.srv.shutdown()
        self.srv.server_close()
        with self.assertRaises(stasis.TransportError) as cm:
            self.client(retries=2).list_episodes()
        self.assertEqual(cm.exception.retried, 2)
        with self.assertRaises(stasis.TransportError) as cm:
            self.client(retries=2).create_checkpoint()
        self.assertEqual(cm.exception.retried, 0)

    def test_token_from_the_environment(self):
        with mock.patch.dict(os.environ, {stasis.TOKEN_ENV: "from-env-0123456789"}):
            c = self.client()
            self.srv.script = [(200, "application/json", b'{"checkpoints": []}', 0), (200, "text/plain", b"ok\n", 0)]
            c.list_checkpoints()
            self.assertTrue(c.healthz())
            self.srv.script = [(200, "application/json", b'{"checkpoints": []}', 0)]
            self.client(token="given-0123456789ab").list_checkpoints()
        self.assertEqual(self.srv.seen[0][2].get("authorization"), "Bearer from-env-0123456789")
        self.assertNotIn("authorization", self.srv.seen[1][2])  # /healthz takes none
        self.assertEqual(self.srv.seen[2][2].get("authorization"), "Bearer given-0123456789ab")

    def test_unauthorized_carries_the_challenge(self):
        self.srv.script = [err(401, "unauthorized", "no token")]
        with self.assertRaises(stasis.Unauthorized) as cm:
            self.client(retries=0).list_episodes()
        self.assertEqual(cm.exception.www_authenticate, 'Bearer realm="stasis"')

    def test_posts_without_a_body_are_json(self):
        self.srv.script = [(201, "application/json", b'{"checkpoint": "c", "episodes": [], "phases": {}, "seconds": 0}', 0)]
        r = self.client().create_checkpoint()
        self.assertEqual(r.checkpoint, "c")
        method, path, headers, body = self.srv.seen[0]
        self.assertEqual((method, path, headers.get("content-type"), headers.get("content-length"), body), ("POST", "/v1/checkpoints", "application/json", "0", b""))

    def test_url_from_the_environment(self):
        with mock.patch.dict(os.environ, {stasis.URL_ENV: self.srv.url}):
            self.srv.script = [(200, "text/plain", b"ok\n", 0)]
            self.assertTrue(stasis.Client(retries=0).healthz())
        with mock.patch.dict(os.environ, {}, clear=True):
            with self.assertRaises(ValueError):
                stasis.Client()

    def test_async(self):
        import asyncio

        self.srv.script = [(200, "application/json", b'{"episodes": []}', 0.2)] * 4

        async def go():
            async with stasis.AsyncClient(self.srv.url, max_workers=4) as c:
                t0 = time.monotonic()
                out = await asyncio.gather(*(c.list_episodes() for _ in range(4)))
                return out, time.monotonic() - t0

        out, took = asyncio.run(go())
        self.assertEqual(out, [[], [], [], []])
        self.assertLess(took, 0.7)  # at once, not one after the other (0.8 s)


if __name__ == "__main__":
    unittest.main()
