"""The ledger reader against `stasis ledger show` and `verify` (the Go
reader) on ledgers written here: cuts, settlements, a relaunch boundary, a
broken mark, a torn last line, format 1, and damaged files. Needs the
stasis binary ($STASIS_BIN), not a server."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import unittest
from unittest import mock

import support
import stasis

T = "2026-01-02T03:04:05.123456789Z"


def line(rec: dict) -> bytes:
    """A ledger line: rec with its hash as the last field."""
    pre = json.dumps(rec, separators=(",", ":"))[:-1] + ',"hash":""}'
    h = hashlib.sha256(pre.encode()).hexdigest()
    return (pre[:-2] + h + '"}').encode()


def chain(recs: list[dict]) -> list[bytes]:
    out, parent = [], ""
    for r in recs:
        r = dict(r, parent=parent)
        b = line(r)
        parent = json.loads(b)["hash"]
        out.append(b)
    return out


def entry(seq: int, call: str, attempt: int = 1, boundary: bool = False, n: int = 3) -> dict:
    e = {
        "kind": "entry",
        "seq": seq,
        "call_id": call,
        "attempt": attempt,
        "request": {"messages": [{"role": "user", "content": call}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": "answer " + call}}]},
        "usage": {"prompt_tokens": 2, "completion_tokens": n},
        "tokens": {"prompt_token_ids": [1, 2], "completion_token_ids": list(range(10, 10 + n)), "logprobs": [-0.5 * (i + 1) for i in range(n)]},
        "started": T,
        "finished": T,
    }
    if boundary:
        e["boundary"] = True
    return e


def header(ep: str, fmt: int = 2) -> dict:
    return {"kind": "ledger", "format": fmt, "episode": ep, "at": T}


def settle(*s: tuple[int, str, str]) -> dict:
    return {"kind": "settle", "settled": [{"seq": q, "call_id": c, "disposition": d} for q, c, d in s], "at": T}


class LedgerTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="stasis-py-ledger-")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def write(self, ep: str, lines: list[bytes], tail: bytes = b"") -> None:
        with open(os.path.join(self.dir, ep + ".ledger"), "wb") as f:
            f.write(b"".join(x + b"\n" for x in lines) + tail)

    def go(self, *args: str) -> tuple[int, dict]:
        p = subprocess.run([support.stasis_bin(), "ledger", *args, "--dir", self.dir, "--json"], capture_output=True, timeout=60)
        return p.returncode, json.loads(p.stdout or b"{}")

    def same_as_go(self, ep: str) -> tuple[stasis.Ledger, stasis.LedgerReport]:
        rep = stasis.verify_ledger(self.dir, ep)
        code, ver = self.go("verify", ep)
        self.assertEqual(code, 0 if rep.ok else 2, ver)
        mine = dataclasses.asdict(rep)
        bad = mine.pop("bad")
        for k, v in mine.items():
            if k in ("path",):
                continue
            self.assertEqual(ver.get(k, "" if isinstance(v, str) else 0), v, k)
        if bad is None:
            self.assertNotIn("bad", ver)
        else:
            self.assertEqual(ver["bad"]["line"], bad["line"])
            self.assertEqual(ver["bad"].get("seq", 0), bad["seq"])
            self.assertEqual(ver["bad"].get("kind", ""), bad["kind"])
            with self.assertRaises(stasis.LedgerError):
                stasis.read_ledger(self.dir, ep)
            return None, rep  # type: ignore[return-value]
        led = stasis.read_ledger(self.dir, ep)
        code, show = self.go("show", ep)
        self.assertEqual(code, 0, show)

        def entries(go: list, py: list[stasis.LedgerEntry]):
            self.assertEqual(len(go), len(py))
            for g, p in zip(go, py):
                self.assertEqual(
                    (g["seq"], g["call_id"], g["attempt"], g["hash"], g["parent"], g["disposition"], g.get("boundary", False), g["response"], g["request"], g.get("usage")),
                    (p.seq, p.call_id, p.attempt, p.hash, p.parent, p.disposition, p.boundary, p.response, p.request, p.usage),
                )
                self.assertEqual(g["tokens"], dataclasses.asdict(p.tokens))

        entries(show["entries"], led.entries)
        entries(show["dropped"], led.dropped)
        self.assertEqual(
            [(e["line"], e["kind"], e["to"], e["from"], e["reason"], e.get("boundary", False)) for e in show["events"]],
            [(e.line, e.kind, e.to, e.from_, e.reason, e.boundary) for e in led.events],
        )
        self.assertEqual((show["total"], show["broken"], show.get("reason", ""), show["format"], show.get("torn_bytes", 0)), (led.total, led.broken, led.reason, led.format, led.torn_bytes))
        return led, rep

    def test_cut_settle_boundary_broken_torn(self):
        recs = [
            header("syn-1"),
            entry(1, "syn-1/1"),
            entry(2, "syn-1/2"),
            settle((1, "syn-1/1", "delivered"), (2, "syn-1/2", "abandoned")),
            entry(3, "syn-1/3"),
            {"kind": "cut", "to": 1, "reason": "relaunch: matched 1", "boundary": True, "at": T},
            entry(2, "syn-1/2b", attempt=2, boundary=True, n=5),
            {"kind": "broken", "reason": "a later relaunch matched nothing", "at": T},
        ]
        self.write("syn-1", chain(recs), tail=b'{"kind":"entry","se')
        led, rep = self.same_as_go("syn-1")
        self.assertEqual([(e.call_id, e.disposition, e.boundary) for e in led.entries], [("syn-1/1", "delivered", False), ("syn-1/2b", "pending", True)])
        self.assertEqual([(e.call_id, e.disposition) for e in led.dropped], [("syn-1/2", "abandoned"), ("syn-1/3", "undelivered")])
        self.assertEqual((led.broken, led.total, led.torn_bytes, led.token_count), (True, 4, len(b'{"kind":"entry","se'), 8))
        self.assertEqual(led.completion_token_ids(), [10, 11, 12, 10, 11, 12, 13, 14])
        self.assertEqual(len(led.logprobs()), 8)
        self.assertEqual((rep.ok, rep.records, rep.entries, rep.live, rep.cuts, rep.delivered, rep.abandoned, rep.pending, rep.undelivered), (True, 8, 4, 2, 1, 1, 1, 1, 1))

    def test_format_1(self):
        self.write("old-1", chain([header("old-1", fmt=1), entry(1, "old-1/1"), entry(2, "old-1/2")]))
        led, rep = self.same_as_go("old-1")
        self.assertEqual([e.disposition for e in led.entries], ["delivered", "delivered"])

    def test_damage(self):
        good = chain([header("dmg-1"), entry(1, "dmg-1/1"), entry(2, "dmg-1/2"), entry(3, "dmg-1/3")])
        cases = {
            "a changed byte": (good[:2] + [good[2].replace(b"answer", b"ANSWER")] + good[3:], 3, "hash mismatch"),
            "a removed line": (good[:2] + good[3:], 3, "parent"),
            "two lines swapped": (good[:2] + [good[3], good[2]], 3, "parent"),
            "a wrong seq": (chain([header("dmg-1"), entry(1, "dmg-1/1"), entry(3, "dmg-1/2")]), 3, "seq 3"),
            "a call twice": (chain([header("dmg-1"), entry(1, "dmg-1/1"), entry(2, "dmg-1/1")]), 3, "already live"),
            "another episode": (chain([header("other"), entry(1, "dmg-1/1")]), 1, "episode"),
            "no header": (chain([entry(1, "dmg-1/1")]), 1, "header"),
            "an unknown kind": (chain([header("dmg-1"), {"kind": "future", "at": T}]), 2, "unknown record kind"),
            "a bad settlement": (chain([header("dmg-1"), entry(1, "dmg-1/1"), settle((1, "dmg-1/9", "delivered"))]), 3, "not dmg-1/9"),
            "a settlement changed": (chain([header("dmg-1"), entry(1, "dmg-1/1"), settle((1, "dmg-1/1", "delivered")), settle((1, "dmg-1/1", "abandoned"))]), 4, "cannot become"),
            "a cut too far": (chain([header("dmg-1"), entry(1, "dmg-1/1"), {"kind": "cut", "to": 5, "reason": "x", "at": T}]), 3, "cut to 5"),
            "not a record": (good[:1] + [b'{"kind":"entry"}'], 2, "not a ledger record"),
            "hash not last": (good[:1] + [good[1][:-1] + b',"x":1}'], 2, "not a ledger record"),
        }
        for what, (lines, at, why) in cases.items():
            with self.subTest(what):
                self.write("dmg-1", lines)
                _, rep = self.same_as_go("dmg-1")
                self.assertFalse(rep.ok)
                self.assertEqual(rep.bad.line, at)
                self.assertIn(why, rep.bad.what)

    def test_missing(self):
        with self.assertRaises(stasis.LedgerNotFound):
            stasis.read_ledger(self.dir, "nobody")
        with self.assertRaises(FileNotFoundError):
            stasis.verify_ledger(self.dir, "nobody")
        with self.assertRaises(ValueError):
            stasis.read_ledger(self.dir, "../escape")
        with mock.patch.dict(os.environ, {stasis.STATE_ENV: ""}):
            with self.assertRaises(ValueError):
                stasis.Client("http://127.0.0.1:9").ledger_dir  # noqa: B018
        with mock.patch.dict(os.environ, {stasis.STATE_ENV: self.dir}):
            self.assertEqual(stasis.Client("http://127.0.0.1:9").ledger_dir, os.path.join(self.dir, "gateway", "ledgers"))


if __name__ == "__main__":
    unittest.main()
