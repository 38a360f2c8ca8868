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

# Fields the server sends that internal/control/openapi/server.json does not declare (each
# reported to the server's maintainers). A field not listed here fails
# test_answers_are_declared: the document or this list must say it.
KNOWN_UNDECLARED: set[str] = set()


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
        # A path no operation serves, a method a path does not take: JSON errors.
        with self.assertRaises(stasis.NotFound) as cm:
            self.raw("GET", "/v1/no-such-route")
        self.assertEqual(cm.exception.type, "not_found")
        with self.assertRaises(stasis.MethodNotAllowed) as cm:
            self.raw("DELETE", "/v1/episodes")
        self.assertEqual((cm.exception.status, cm.exception.type), (405, "method_not_allowed"))
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
        # and as `stasis ledger` reads the same file.
        led = c.ledger("life-1")
        self.assertIsInstance(led, stasis.Ledger)
        self.assertEqual((led.episode, led.live, led.more), ("life-1", got.model_calls, False))
        self.assertEqual(len(led.entries), got.model_calls)
        self.assertGreater(len(led.entries), 1)
        self.assertEqual([e.seq for e in led.entries], list(range(1, len(led.entries) + 1)))
        self.assertEqual(len({e.call_id for e in led.entries}), len(led.entries))
        for e in led.entries:
            self.assertIsNotNone(e.tokens)
            self.assertGreater(len(e.tokens.prompt_token_ids), 0)
            self.assertGreater(len(e.tokens.completion_token_ids), 0)
            self.assertEqual(len(e.tokens.completion_token_ids), len(e.tokens.logprobs))
            self.assertTrue(all(lp <= 0 for lp in e.tokens.logprobs))
            self.assertIsNotNone(e.request)
            self.assertIsNotNone(e.response)
            self.assertIsInstance(e.started, datetime)
            self.assertIn(e.disposition, ("delivered", "abandoned"))  # an ended episode's calls are settled
        self.assertEqual(led.token_count, sum(len(e.tokens.completion_token_ids) for e in led.entries))
        self.assertEqual(led.token_count, len(led.completion_token_ids()))
        self.assertEqual(led.token_count, len(led.logprobs()))
        self.assertFalse(led.broken)
        rep = c.verify_ledger("life-1")
        self.assertIsInstance(rep, stasis.LedgerReport)
        self.assertTrue(rep.ok)
        self.assertIsNone(rep.bad)
        self.assertEqual(rep.live, len(led.entries))
        self.assertRegex(rep.head, r"^[0-9a-f]{64}$")  # the last record's (a settle record, often)
        self.assertEqual(rep.delivered + rep.abandoned + rep.pending + rep.undelivered, rep.entries)
        self.compare_with_go("life-1", led)
        self.pages("life-1", led)

        r = c.retire_episode("life-1")
        self.assertEqual((r.state, r.live), ("retired", False))
        self.assertEqual(c.retire_episode("life-1").state, "retired")  # once
        self.assertTrue(c.verify_episode("life-1").recorded)
        self.assertEqual(c.ledger("life-1").entries, led.entries)  # a retired episode keeps its ledger

        # Last: a changed byte in the server's own file. The ledger is then
        # refused (409), and its verify names the line, as Go's does.
        self.damaged("life-1", led)

    def ledger_dir(self) -> str:
        return os.path.join(self.served.state, "gateway", "ledgers")

    def compare_with_go(self, episode: str, led: stasis.Ledger):
        """The API's ledger and verify are `stasis ledger show` and `verify`
        of the same file, field for field."""
        code, show = go_json("ledger", "show", episode, "--dir", self.ledger_dir())
        self.assertEqual(code, 0, show)
        _, _, body = self.raw("GET", f"/v1/episodes/{episode}/ledger")
        api = json.loads(body)
        self.assertEqual((api.pop("live"), api.pop("more")), (len(show["entries"]), False))
        self.assertEqual(api, show)
        self.assertEqual(len(show["entries"]), len(led.entries))
        for g, p in zip(show["entries"], led.entries):
            self.assertEqual((g["seq"], g["call_id"], g["hash"], g["parent"], g["disposition"], g.get("boundary", False)), (p.seq, p.call_id, p.hash, p.parent, p.disposition, p.boundary))
            self.assertEqual(g["tokens"]["completion_token_ids"], p.tokens.completion_token_ids)
            self.assertEqual(g["tokens"]["prompt_token_ids"], p.tokens.prompt_token_ids)
            self.assertEqual(g["tokens"]["logprobs"], p.tokens.logprobs)
            self.assertEqual((g["request"], g["response"], g.get("usage")), (p.request, p.response, p.usage))
        self.assertEqual((show["total"], show["broken"], len(show["events"]), len(show["dropped"])), (led.total, led.broken, len(led.events), len(led.dropped)))
        code, ver = go_json("ledger", "verify", episode, "--dir", self.ledger_dir())
        self.assertEqual(code, 0, ver)
        _, _, body = self.raw("GET", f"/v1/episodes/{episode}/ledger/verify")
        self.assertEqual(json.loads(body), ver)

    def pages(self, episode: str, led: stasis.Ledger):
        """One entry a page, without bodies: the same entries, request and
        response left out."""
        c = self.c
        got, after = [], 0
        while True:
            p = c.get_ledger(episode, after=after, limit=1, bodies=False)
            self.assertEqual((p.live, p.total, len(p.events)), (len(led.entries), led.total, len(led.events)))
            self.assertLessEqual(len(p.entries), 1)
            got += p.entries
            if not p.more:
                break
            after = p.entries[-1].seq
        self.assertEqual(len(got), len(led.entries))
        for g, e in zip(got, led.entries):
            self.assertEqual((g.request, g.response), (None, None))
            self.assertEqual((g.seq, g.call_id, g.hash, g.tokens, g.usage, g.disposition), (e.seq, e.call_id, e.hash, e.tokens, e.usage, e.disposition))
        for d in c.get_ledger(episode, bodies=False).dropped:
            self.assertEqual((d.request, d.response), (None, None))
        # Past the end: an empty page.
        p = c.get_ledger(episode, after=len(led.entries))
        self.assertEqual((p.entries, p.more, p.live), ([], False, len(led.entries)))
        # The whole ledger without bodies, through the pages.
        self.assertEqual([e.hash for e in c.ledger(episode, bodies=False).entries], [e.hash for e in led.entries])
        for bad in (dict(limit=0), dict(limit=10001), dict(after=-1)):
            with self.assertRaises(stasis.InvalidRequest):
                c.get_ledger(episode, **bad)

    def damaged(self, episode: str, led: stasis.Ledger):
        """Rewrite one byte of the second entry's call_id in the server's
        file (the episode is retired: nothing appends to it)."""
        c = self.c
        path = os.path.join(self.ledger_dir(), episode + ".ledger")
        with open(path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        i = [n for n, line in enumerate(lines) if b'"kind":"entry"' in line][1]
        old = b'"call_id":"' + led.entries[1].call_id.encode() + b'"'
        self.assertIn(old, lines[i])
        new = old[:-2] + (b"X" if old[-2:-1] != b"X" else b"Y") + b'"'
        lines[i] = lines[i].replace(old, new, 1)
        with open(path, "wb") as f:
            f.write(b"\n".join(lines))
        with self.assertRaises(stasis.Conflict) as cm:
            c.get_ledger(episode)
        self.assertEqual((cm.exception.status, cm.exception.type), (409, "conflict"))
        self.assertIn("verify", cm.exception.message)
        with self.assertRaises(stasis.Conflict):
            c.ledger(episode)
        rep = c.verify_ledger(episode)
        self.assertFalse(rep.ok)
        self.assertIsNotNone(rep.bad)
        self.assertEqual(rep.bad.line, i + 1)
        self.assertIn("hash mismatch", rep.bad.what)
        self.assertEqual(rep.head, json.loads(lines[i - 1])["hash"])  # the last good record
        code, ver = go_json("ledger", "verify", episode, "--dir", self.ledger_dir())
        self.assertEqual(code, 2)
        _, _, body = self.raw("GET", f"/v1/episodes/{episode}/ledger/verify")
        self.assertEqual(json.loads(body), ver)
        self.assertFalse(c.get_episode(episode).ledger_ok)

    def test_5_ledger_edges(self):
        c = self.c
        # An episode that made no model call (its harness's budget is a
        # millisecond) has an empty ledger, which verifies.
        ep = c.start_episode(TASK_PY, "mini", id="no-calls", deadline_s=0.001)
        self.assertEqual(ep.deadline_s, 0.001)
        (ended,) = c.wait_episodes(["no-calls"], timeout=WAIT)
        self.assertEqual(ended.model_calls, 0)
        led = c.get_ledger("no-calls")
        self.assertEqual((led.episode, led.entries, led.dropped, led.events, led.total, led.live, led.more, led.broken), ("no-calls", [], [], [], 0, 0, False, False))
        self.assertEqual((c.ledger("no-calls").entries, c.ledger("no-calls").token_count), ([], 0))
        rep = c.verify_ledger("no-calls")
        self.assertEqual((rep.ok, rep.records, rep.entries, rep.live), (True, 0, 0, 0))
        self.assertEqual(c.retire_episode("no-calls").state, "retired")
        # An unknown episode.
        for call in (lambda: c.get_ledger("no-such-episode"), lambda: c.verify_ledger("no-such-episode"), lambda: c.ledger("no-such-episode")):
            with self.assertRaises(stasis.NotFound) as cm:
                call()
            self.assertEqual((cm.exception.status, cm.exception.type), (404, "not_found"))
        with self.assertRaises(stasis.InvalidRequest):
            self.raw("GET", "/v1/episodes/no-calls/ledger?bodies=maybe")

    def test_6_tasks(self):
        tasks = self.c.list_tasks()
        self.assertGreater(len(tasks), 0)
        ids = {t.id for t in tasks}
        self.assertEqual(len(ids), len(tasks))
        self.assertTrue({TASK_PY, TASK_SH} <= ids, ids)
        for t in tasks:
            self.assertIsInstance(t, stasis.TaskSummary)
            self.assertGreater(t.budget_s, 0)
            self.assertGreater(t.fail_to_pass, 0)

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

        # A restore over live episodes changes nothing, scoped or not.
        with self.assertRaises(stasis.Conflict) as cm:
            c.restore_checkpoint("ck-one")
        self.assertIn("live", cm.exception.message)
        with self.assertRaises(stasis.Conflict):
            c.restore_checkpoint("ck-one", episodes=["ck-a"])
        with self.assertRaises(stasis.NotFound):
            c.restore_checkpoint("ck-one", episodes=["no-such-episode"])
        with self.assertRaises(stasis.InvalidRequest):
            c.restore_checkpoint("ck-one", episodes=[])
        d = c.get_checkpoint("ck-one")
        self.assertEqual((d.progress.nodes, d.progress.nodes_done, d.progress.records), (1, 1, len(d.records)))

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
            pos = rec.relay_position if rec.relay_position is not None else rec.relay_delivered
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

        # A scoped restore: the one episode named comes back (though
        # retired; as its next attempt when it has one to run); the others
        # stay as they are.
        before = c.get_episode("ck-a")
        res = c.restore_checkpoint("ck-two", episodes=["ck-a"])
        self.assertIsInstance(res, stasis.RestoreResult)
        self.assertEqual((res.checkpoint, [f.episode for f in res.episodes]), ("ck-two", ["ck-a"]))
        self.assertIsNone(res.restore)  # a server on its own
        after = c.get_episode("ck-a")
        self.assertEqual(before.state, "retired")
        if res.episodes[0].finished:
            # Its harness had ended at the checkpoint: back as ended, with
            # its verdict, nothing to run.
            self.assertEqual((after.state, res.episodes[0].resume), ("ended", "none"))
        else:
            self.assertEqual(after.state, "running")
            self.assertGreater(after.attempt, before.attempt)
        self.assertEqual(c.get_episode("ck-b").state, "retired")
        self.assertEqual(c.retire_episode("ck-a").state, "retired")

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
        check("TaskList", "GET", "/v1/tasks")
        for e in c.list_episodes():
            check("LedgerReport", "GET", f"/v1/episodes/{e.id}/ledger/verify")
            if c.verify_ledger(e.id).ok:  # life-1's was damaged on purpose
                check("Ledger", "GET", f"/v1/episodes/{e.id}/ledger")
        check("CheckpointResult", "POST", "/v1/checkpoints")
        if os.environ.get("STASIS_PY_VERBOSE"):
            print("undeclared:", sorted(found))
        self.assertEqual(found - KNOWN_UNDECLARED, set(), "the server sends fields internal/control/openapi/server.json does not declare")


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
