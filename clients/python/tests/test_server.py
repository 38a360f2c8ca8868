"""The client against a real `stasis serve`: the local provider, the
server's embedded scripted model, the built-in tasks. Each class starts its
own server on a fresh temporary state directory and, at the end, kills
everything it started and removes the directory, and checks that nothing
is left.

Needs the stasis binary: $STASIS_BIN (default ./bin/stasis, with
stasis-sandbox beside it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import unittest
from datetime import datetime
from unittest import mock

import support
import conformance
import stasis

TASK_PY = "py-ini-value-with-equals"
TASK_SH = "sh-renext-spaces"
WAIT = 300.0  # seconds an episode may take, under load

# Fields the server sends that openapi/server.json does not declare (each
# reported to the server's maintainers). A field not listed here fails
# test_answers_are_declared: the document or this list must say it.
KNOWN_UNDECLARED = {
    "Episode.environment",  # store.Episode.Environment
    "Episode.deadline_s",  # store.Episode.DeadlineS, when the start gave one
    "Episode.limits",  # store.Episode.Limits, when the start gave some
}


def go_json(*args: str) -> tuple[int, dict]:
    """Run the stasis binary with --json; its exit status and document."""
    p = subprocess.run([support.stasis_bin(), *args, "--json"], capture_output=True, timeout=60)
    return p.returncode, json.loads(p.stdout or b"{}")


class ServerTest(unittest.TestCase):
    served: support.Served
    c: stasis.Client
    spec: dict

    @classmethod
    def setUpClass(cls):
        cls.spec = support.load_spec()
        cls.served = support.Served()
        cls.c = cls.served.client()

    @classmethod
    def tearDownClass(cls):
        left = cls.served.close()
        if left:
            raise AssertionError(f"left behind: {left}")

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """A request the client would not make, through its transport."""
        h = {"Content-Type": "application/json"} if method != "GET" else {}
        h.update(headers or {})
        return self.c._send(method, self.c.base + path, body if method != "GET" else None, h, 60)

    # --- the server ---------------------------------------------------------

    def test_1_service(self):
        self.assertTrue(self.c.healthz())
        m = self.c.metrics()
        self.assertIn("# TYPE", m)
        self.assertIn("stasis_", m)
        self.assertEqual(self.c.openapi(), self.spec)

    def test_2_errors(self):
        c = self.c
        with self.assertRaises(stasis.NotFound) as cm:
            c.get_episode("no-such-episode")
        self.assertEqual((cm.exception.status, cm.exception.type), (404, "not_found"))
        with self.assertRaises(stasis.NotFound):
            c.get_checkpoint("no-such-checkpoint")
        with self.assertRaises(stasis.NotFound):
            c.verify_episode("no-such-episode")
        with self.assertRaises(stasis.NotFound):
            c.restore_checkpoint("no-such-checkpoint")
        for bad in (
            lambda: c.start_episode("no-such-task", "mini"),
            lambda: c.start_episode(TASK_PY, "no-such-harness"),
            lambda: c.start_episode(TASK_PY, "mini", id="not a name"),
            lambda: c.start_episode(TASK_PY, "mini", pause_mode="hold"),  # the local provider's snapshots keep files only
            lambda: c.start_episode(TASK_PY, "mini", deadline_s=-1),
            lambda: c.list_episodes(state="sleeping"),
            lambda: c.list_checkpoints(state="sleeping"),
            lambda: c.list_checkpoints(limit=-1),
            lambda: c.create_checkpoint(id="not a name"),
            lambda: c.create_checkpoint(stragglers="sometimes"),
        ):
            with self.assertRaises(stasis.InvalidRequest) as cm:
                bad()
            self.assertEqual((cm.exception.status, cm.exception.type), (400, "invalid_request"))
            self.assertTrue(cm.exception.message)
        with self.assertRaises(stasis.InvalidRequest) as cm:
            self.raw("POST", "/v1/episodes", json.dumps({"task": TASK_PY, "harness": "mini", "colour": "red"}).encode())
        self.assertIn("colour", cm.exception.message)
        with self.assertRaises(stasis.UnsupportedMediaType) as cm:
            self.raw("POST", "/v1/checkpoints", b"", {"Content-Type": "text/plain"})
        self.assertEqual(cm.exception.status, 415)
        with self.assertRaises(stasis.TooLarge):
            self.raw("POST", "/v1/episodes", json.dumps({"task": "x" * (1 << 20), "harness": "mini"}).encode())
        with self.assertRaises(stasis.Forbidden):
            self.raw("POST", "/v1/checkpoints", b"", {"Sec-Fetch-Site": "cross-site"})
        # None of these made anything.
        self.assertEqual([e for e in c.list_episodes() if e.task == "no-such-task"], [])

    # --- an episode, start to retire -------------------------------------------

    def test_3_episode(self):
        c = self.c
        ep = c.start_episode(TASK_PY, "mini", id="life-1")
        self.assertEqual((ep.id, ep.task, ep.harness, ep.provider, ep.state, ep.live), ("life-1", TASK_PY, "mini", "local", "running", True))
        self.assertTrue(ep.token_path)
        self.assertTrue(ep.sandbox)
        self.assertIsInstance(ep.created, datetime)
        self.assertIsNone(ep.reward)
        with self.assertRaises(stasis.Conflict):
            c.start_episode(TASK_PY, "mini", id="life-1")

        # Verify before the harness ended is a conflict; after, a verdict.
        try:
            early = c.verify_episode("life-1")
        except stasis.Conflict:
            early = None
        if early is not None:
            self.assertTrue(c.get_episode("life-1").harness_ended, "verified while the harness ran")

        self.assertIn("life-1", [e.id for e in c.list_episodes(task=TASK_PY)])
        self.assertNotIn("life-1", [e.id for e in c.list_episodes(harness="opencode")])
        self.assertNotIn("life-1", [e.id for e in c.list_episodes(state="retired")])

        (ended,) = c.wait_episodes(["life-1"], timeout=WAIT)
        self.assertTrue(ended.harness_ended)
        v = c.verify_episode("life-1")
        self.assertIsInstance(v, stasis.VerifyResult)
        self.assertEqual(v.recorded, early is not None)
        self.assertEqual((v.verdict.episode, v.verdict.task), ("life-1", TASK_PY))
        self.assertIn(v.verdict.reward, (0, 1))
        self.assertEqual(v.verdict.reward == 1, v.verdict.status == "resolved")
        again = c.verify_episode("life-1")
        self.assertTrue(again.recorded)
        self.assertEqual((again.verdict.reward, again.verdict.started), (v.verdict.reward, v.verdict.started))

        got = c.get_episode("life-1")
        self.assertEqual((got.state, got.reward, got.verdict, got.ledger_ok), ("ended", v.verdict.reward, v.verdict.status, True))
        self.assertIn("life-1", [e.id for e in c.list_episodes(state="ended")])

        # The ledger: every call with its tokens, as the server counts it
        # and as `stasis ledger` reads it.
        led = c.ledger("life-1")
        self.assertEqual(len(led.entries), got.model_calls)
        self.assertGreater(len(led.entries), 0)
        self.assertEqual([e.seq for e in led.entries], list(range(1, len(led.entries) + 1)))
        self.assertEqual(len({e.call_id for e in led.entries}), len(led.entries))
        for e in led.entries:
            self.assertIsNotNone(e.tokens)
            self.assertGreater(len(e.tokens.prompt_token_ids), 0)
            self.assertGreater(len(e.tokens.completion_token_ids), 0)
            self.assertEqual(len(e.tokens.completion_token_ids), len(e.tokens.logprobs))
            self.assertTrue(all(lp <= 0 for lp in e.tokens.logprobs))
        self.assertEqual(led.token_count, sum(len(e.tokens.completion_token_ids) for e in led.entries))
        self.assertFalse(led.broken)
        rep = c.verify_ledger("life-1")
        self.assertTrue(rep.ok)
        self.assertEqual(rep.live, len(led.entries))
        self.assertEqual(rep.delivered + rep.abandoned + rep.pending + rep.undelivered, rep.entries)
        self.compare_with_go("life-1", led, rep)
        self.tampered("life-1")

        r = c.retire_episode("life-1")
        self.assertEqual((r.state, r.live), ("retired", False))
        self.assertEqual(c.retire_episode("life-1").state, "retired")  # once
        self.assertTrue(c.verify_episode("life-1").recorded)

    def compare_with_go(self, episode: str, led: stasis.Ledger, rep: stasis.LedgerReport):
        code, show = go_json("ledger", "show", episode, "--dir", self.c.ledger_dir)
        self.assertEqual(code, 0, show)
        self.assertEqual(len(show["entries"]), len(led.entries))
        for g, p in zip(show["entries"], led.entries):
            self.assertEqual((g["seq"], g["call_id"], g["hash"], g["disposition"], g.get("boundary", False)), (p.seq, p.call_id, p.hash, p.disposition, p.boundary))
            self.assertEqual(g["tokens"]["completion_token_ids"], p.tokens.completion_token_ids)
            self.assertEqual(g["tokens"]["prompt_token_ids"], p.tokens.prompt_token_ids)
            self.assertEqual(g["tokens"]["logprobs"], p.tokens.logprobs)
            self.assertEqual(g["response"], p.response)
        self.assertEqual((show["total"], show["broken"], len(show["events"]), len(show["dropped"])), (led.total, led.broken, len(led.events), len(led.dropped)))
        code, ver = go_json("ledger", "verify", episode, "--dir", self.c.ledger_dir)
        self.assertEqual(code, 0, ver)
        for k in ("ok", "records", "entries", "live", "cuts", "broken", "head", "delivered", "abandoned", "pending", "undelivered", "format"):
            self.assertEqual(ver[k], getattr(rep, k), k)

    def tampered(self, episode: str):
        """A changed byte, and a torn last line, found as Go finds them."""
        tmp = tempfile.mkdtemp(prefix="stasis-py-ledger-")
        try:
            src = os.path.join(self.c.ledger_dir, episode + ".ledger")
            with open(src, "rb") as f:
                data = f.read()
            lines = data.split(b"\n")
            i = [n for n, line in enumerate(lines) if b'"kind":"entry"' in line][1]  # the second entry's line
            self.assertIn(b'"completion_token_ids":[', lines[i])
            bad = lines[:]
            bad[i] = bad[i].replace(b'"completion_token_ids":[', b'"completion_token_ids":[1,', 1)
            with open(os.path.join(tmp, episode + ".ledger"), "wb") as f:
                f.write(b"\n".join(bad))
            rep = stasis.verify_ledger(tmp, episode)
            self.assertFalse(rep.ok)
            self.assertEqual(rep.bad.line, i + 1)
            self.assertIn("hash mismatch", rep.bad.what)
            code, ver = go_json("ledger", "verify", episode, "--dir", tmp)
            self.assertEqual(code, 2)
            self.assertEqual((ver["ok"], ver["bad"]["line"], ver["records"]), (False, rep.bad.line, rep.records))
            with self.assertRaises(stasis.LedgerError):
                stasis.read_ledger(tmp, episode)
            # A removed line breaks the chain.
            with open(os.path.join(tmp, episode + ".ledger"), "wb") as f:
                f.write(b"\n".join(lines[:i] + lines[i + 1 :]))
            rep = stasis.verify_ledger(tmp, episode)
            self.assertEqual((rep.ok, rep.bad.line), (False, i + 1))
            self.assertIn("parent", rep.bad.what)
            # A torn last line (a crash mid-append) is ignored.
            with open(os.path.join(tmp, episode + ".ledger"), "wb") as f:
                f.write(data + b'{"kind":"entry","seq":')
            rep = stasis.verify_ledger(tmp, episode)
            self.assertTrue(rep.ok)
            self.assertEqual(rep.torn_bytes, len(b'{"kind":"entry","seq":'))
            code, ver = go_json("ledger", "verify", episode, "--dir", tmp)
            self.assertEqual((code, ver["ok"], ver["torn_bytes"]), (0, True, rep.torn_bytes))
            with self.assertRaises(stasis.LedgerNotFound):
                stasis.read_ledger(tmp, "no-such-episode")
        finally:
            shutil.rmtree(tmp)

    # --- checkpoints ---------------------------------------------------------------

    def test_4_checkpoints(self):
        c = self.c

        async def start_two():
            async with stasis.AsyncClient(client=c) as ac:
                return await asyncio.gather(ac.start_episode(TASK_PY, "mini", id="ck-a"), ac.start_episode(TASK_SH, "mini", id="ck-b", deadline_s=900, limits=stasis.Limits(pids=2048)))

        a, b = asyncio.run(start_two())
        self.assertEqual((a.id, b.id), ("ck-a", "ck-b"))

        ck = c.create_checkpoint(id="ck-one")
        self.assertEqual(ck.checkpoint, "ck-one")
        figs = {f.episode: f for f in ck.episodes}
        self.assertTrue({"ck-a", "ck-b"} <= set(figs), figs)
        for f in figs.values():
            self.assertFalse(f.excluded, f.reason)
            self.assertTrue(f.finished or f.snapshot, f)
        self.assertGreater(ck.seconds, 0)
        with self.assertRaises(stasis.Conflict):
            c.create_checkpoint(id="ck-one")

        self.assertIn("ck-one", [x.id for x in c.list_checkpoints(state="committed")])
        self.assertEqual(len(c.list_checkpoints(limit=1)), 1)
        self.assertEqual(c.latest_checkpoint().id, "ck-one")
        d = c.get_checkpoint("ck-one")
        self.assertEqual((d.checkpoint.id, d.checkpoint.state), ("ck-one", "committed"))
        self.assertIsInstance(d.checkpoint.committed, datetime)
        self.assertEqual(d.checkpoint.episodes, len(d.records))
        recs = {r.episode: r for r in d.records}
        for e, f in figs.items():
            self.assertEqual(recs[e].snapshot_id, f.snapshot)
            self.assertEqual((recs[e].provider, recs[e].finished), ("local", f.finished))

        # A restore over live episodes changes nothing.
        with self.assertRaises(stasis.Conflict) as cm:
            c.restore_checkpoint("ck-one")
        self.assertIn("live", cm.exception.message)

        # A branch of an episode still running at the checkpoint: a copy
        # whose ledger starts as the episode's up to the recorded position.
        if os.environ.get("STASIS_PY_VERBOSE"):
            print("at the checkpoint:", {e: ("finished" if f.finished else "running") for e, f in figs.items()})
        copies = []
        for e, f in sorted(figs.items()):
            if f.finished:
                with self.assertRaises(stasis.Conflict):
                    c.branch_checkpoint("ck-one", e, copies=1)
                continue
            br = c.branch_checkpoint("ck-one", e, ids=[e + "-copy"])
            self.assertEqual([x.episode for x in br.episodes], [e + "-copy"])
            self.assertEqual(c.get_episode(e + "-copy").origin, e)
            copies.append((e, e + "-copy", recs[e]))

        ids = ["ck-a", "ck-b"] + [cp for _, cp, _ in copies]
        for ep in c.wait_episodes(ids, timeout=WAIT):
            v = c.verify_episode(ep.id).verdict
            self.assertIn(v.reward, (0, 1))
            self.assertTrue(c.verify_ledger(ep.id).ok)
        for orig, cp, rec in copies:
            o, k = c.ledger(orig), c.ledger(cp)
            pos = rec.extra.get("relay_position", rec.relay_delivered)
            self.assertGreater(len(k.entries), 0)
            for i in range(min(pos, len(o.entries), len(k.entries))):
                self.assertEqual(k.entries[i].response, o.entries[i].response, f"{cp} entry {i + 1}")

        ck2 = c.create_checkpoint(id="ck-two", stragglers="exclude")
        self.assertEqual(ck2.checkpoint, "ck-two")
        self.assertEqual(c.latest_checkpoint().id, "ck-two")
        freed = c.delete_checkpoint("ck-one")
        self.assertIsInstance(freed, list)
        for s in freed:
            self.assertIsInstance(s, stasis.FreedSnapshot)
            self.assertEqual(s.provider, "local")
            self.assertIn(s.snapshot_id, {f.snapshot for f in figs.values()})
        with self.assertRaises(stasis.NotFound):
            c.get_checkpoint("ck-one")
        with self.assertRaises(stasis.NotFound):
            c.delete_checkpoint("ck-one")
        for e in ids:
            self.assertEqual(c.retire_episode(e).state, "retired")

    # --- what the server sends, against the document ------------------------------

    def test_9_answers_are_declared(self):
        c = self.c
        found: set[str] = set()

        def check(schema: str, method: str, path: str):
            _, _, body = self.raw(method, path, b"" if method == "POST" else None)
            found.update(conformance.undeclared(self.spec, schema, json.loads(body)))

        self.assertGreater(len(c.list_episodes()), 0)
        self.assertGreater(len(c.list_checkpoints()), 0)
        check("EpisodeList", "GET", "/v1/episodes")
        for e in c.list_episodes():
            check("Episode", "GET", "/v1/episodes/" + e.id)
        check("CheckpointList", "GET", "/v1/checkpoints")
        for ck in c.list_checkpoints():
            check("CheckpointDetail", "GET", "/v1/checkpoints/" + ck.id)
        check("VerifyResponse", "POST", "/v1/episodes/life-1/verify")
        check("CheckpointResult", "POST", "/v1/checkpoints")
        if os.environ.get("STASIS_PY_VERBOSE"):
            print("undeclared:", sorted(found))
        self.assertEqual(found - KNOWN_UNDECLARED, set(), "the server sends fields openapi/server.json does not declare")


class AuthTest(unittest.TestCase):
    """A server that takes bearer tokens (--api-token-file), on loopback."""

    TOKEN = "py-client-test-token-0123456789"

    @classmethod
    def setUpClass(cls):
        cls.tokdir = tempfile.mkdtemp(prefix="stasis-py-tok-")
        path = os.path.join(cls.tokdir, "tokens")
        with open(path, "w") as f:
            f.write("# tokens\n" + cls.TOKEN + "\n")
        try:
            cls.served = support.Served(args=["--api-token-file", path], listen="127.0.0.1:0")
        except BaseException:
            shutil.rmtree(cls.tokdir)
            raise

    @classmethod
    def tearDownClass(cls):
        left = cls.served.close()
        shutil.rmtree(cls.tokdir)
        if left or os.path.exists(cls.tokdir):
            raise AssertionError(f"left behind: {left}")

    def test_tokens(self):
        addr = self.served.server.address
        self.assertFalse(addr.startswith("unix:"))
        with mock.patch.dict(os.environ, {stasis.TOKEN_ENV: ""}):
            anon = stasis.Client(addr, retries=0)
            self.assertIsNone(anon.token)
            self.assertTrue(anon.healthz())  # liveness takes no credentials
            with self.assertRaises(stasis.Unauthorized) as cm:
                anon.list_episodes()
            self.assertEqual((cm.exception.status, cm.exception.type), (401, "unauthorized"))
            self.assertTrue(cm.exception.www_authenticate.startswith("Bearer"))
            with self.assertRaises(stasis.Unauthorized) as cm:
                stasis.Client(addr, token="wrong-token-0123456789", retries=0).metrics()
            self.assertIn("invalid_token", cm.exception.www_authenticate)
        self.assertEqual(stasis.Client(addr, token=self.TOKEN).list_episodes(), [])
        with mock.patch.dict(os.environ, {stasis.TOKEN_ENV: self.TOKEN}):
            c = stasis.Client(addr)
            self.assertEqual(c.list_checkpoints(), [])
            self.assertIn("stasis_", c.metrics())
            with self.assertRaises(stasis.Misdirected):
                c._send("GET", c.base + "/v1/episodes", None, {"Host": "evil.example", "Authorization": "Bearer " + self.TOKEN}, 30)


if __name__ == "__main__":
    unittest.main()
