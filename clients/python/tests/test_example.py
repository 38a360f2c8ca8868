"""examples/rollout_loop.py, run as a trainer would run it, and its output
checked against what the state directory holds (read by `stasis ledger`,
and by a new server: its recorded verdicts and its ledgers)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import support
from stasis.local import LocalServer, gateway_socket_dir

EXAMPLE = os.path.join(support.REPO, "examples", "rollout_loop.py")
ROW = re.compile(r"^(rollout-\d{3})\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)$")


def go_json(*args: str) -> tuple[int, dict]:
    p = subprocess.run([support.stasis_bin(), *args, "--json"], capture_output=True, timeout=60)
    return p.returncode, json.loads(p.stdout or b"{}")


class RolloutLoopTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="stasis-py-ex-")
        self.state = os.path.join(self.tmp, "state")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.assertFalse(os.path.exists(self.tmp))
        self.assertFalse(os.path.exists(gateway_socket_dir(self.state)))

    def test_rollout_loop(self):
        n = 3
        summary = os.path.join(self.tmp, "batch.json")
        env = dict(os.environ, STASIS_BIN=support.stasis_bin(), PYTHONPATH=support.CLIENT_DIR)
        p = subprocess.run(
            [sys.executable, EXAMPLE, "--episodes", str(n), "--checkpoint-every", "4", "--state", self.state, "--json", summary, "--timeout", "600"],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        out = p.stdout
        if os.environ.get("STASIS_PY_VERBOSE"):
            print(out)
        self.assertEqual(p.returncode, 0, f"stdout:\n{out}\nstderr:\n{p.stderr}")

        # Every episode's reward and token count, in the output.
        rows = {m.group(1): m.groups() for m in map(ROW.match, out.splitlines()) if m}
        self.assertEqual(sorted(rows), [f"rollout-{i:03d}" for i in range(n)], out)
        with open(summary) as f:
            batch = {r["episode"]: r for r in json.load(f)}
        self.assertEqual(set(batch), set(rows))
        for ep, (_, task, reward, calls, tokens, logprobs, resumed) in rows.items():
            r = batch[ep]
            self.assertEqual((task, int(reward), int(calls), int(tokens), int(logprobs), resumed), (r["task"], r["reward"], r["calls"], r["tokens"], r["logprobs"], r["resumed"]))
            self.assertIn(r["reward"], (0, 1))
            self.assertGreater(r["tokens"], 0)
            self.assertEqual(r["tokens"], r["logprobs"])

        # The preemption happened: a checkpoint, both processes killed, a
        # restore of the latest committed checkpoint.
        self.assertRegex(out, r"step \d+: checkpoint \S+ committed")
        self.assertRegex(out, r"preempted: SIGKILL to the server and \d+ sandboxes")
        m = re.search(r"restored (\S+): (.*) \(", out)
        self.assertIsNotNone(m, out)
        restored = dict(x.split(" ") for x in m.group(2).split(", "))
        self.assertEqual(set(restored), set(rows))
        for ep, (_, _, _, _, _, _, resumed) in rows.items():
            self.assertEqual(restored[ep], resumed)
        # Restored from a checkpoint taken mid-episode (the model is slowed
        # for that), at least one episode was relaunched.
        self.assertIn("relaunch", restored.values(), out)

        # The tokens are the ledger's, as Go reads it: the logical ledger
        # after the restore, each call once.
        ledgers = os.path.join(self.state, "gateway", "ledgers")
        for ep, r in batch.items():
            code, show = go_json("ledger", "show", ep, "--dir", ledgers)
            self.assertEqual(code, 0, show)
            self.assertFalse(show["broken"])
            entries = show["entries"]
            self.assertEqual(len(entries), r["calls"])
            self.assertEqual(sum(len(e["tokens"]["completion_token_ids"]) for e in entries), r["tokens"])
            self.assertEqual(len({e["call_id"] for e in entries}), len(entries))
            if r["resumed"] == "relaunch":
                cuts = [e for e in show["events"] if e["kind"] == "cut"]
                self.assertTrue(cuts, f"{ep} was relaunched, yet its ledger has no cut")
            code, ver = go_json("ledger", "verify", ep, "--dir", ledgers)
            self.assertEqual((code, ver["ok"]), (0, True))

        # The rewards are the verdicts the server recorded, the tokens its
        # ledgers'.
        srv = LocalServer(self.state, binary=support.stasis_bin())
        try:
            srv.start()
            c = srv.client()
            for ep, r in batch.items():
                v = c.verify_episode(ep)
                self.assertTrue(v.recorded)
                self.assertEqual(v.verdict.reward, r["reward"])
                self.assertEqual(c.get_episode(ep).state, "retired")
                led = c.ledger(ep)
                self.assertEqual((len(led.entries), led.token_count, len(led.logprobs())), (r["calls"], r["tokens"], r["logprobs"]))
        finally:
            srv.close()
        self.assertEqual(srv.leftovers(), [])


if __name__ == "__main__":
    unittest.main()
