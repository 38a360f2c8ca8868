"""The client against internal/control/openapi/server.json: every operation, every field of
the schemas the dataclasses mirror, and what each method puts on the wire.
No server needed."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import typing
import unittest
import urllib.parse
from datetime import datetime

import support  # noqa: F401  (the import path)
import conformance
import stasis
from stasis import models
from stasis.client import OPERATIONS, Client


class DocumentTest(unittest.TestCase):
    spec: dict

    @classmethod
    def setUpClass(cls):
        cls.spec = support.load_spec()

    def test_client_conforms(self):
        self.assertEqual(conformance.problems(self.spec), [])

    def test_every_operation_is_covered(self):
        ops = {
            sop["operationId"]
            for item in self.spec["paths"].values()
            for m, sop in item.items()
            if m in conformance.METHODS
        }
        self.assertEqual(ops, set(OPERATIONS))
        self.assertGreaterEqual(len(ops), 17)

    def _changed(self, change, want: str):
        """After change(spec), the check must complain, naming want."""
        m = copy.deepcopy(self.spec)
        change(m)
        got = conformance.problems(m)
        self.assertTrue(any(want in p for p in got), f"no problem naming {want!r} in {got}")

    def test_a_new_property_fails(self):
        self._changed(lambda m: m["components"]["schemas"]["Episode"]["properties"].update(shiny={"type": "string"}), "Episode.shiny")
        self._changed(lambda m: m["components"]["schemas"]["Verdict"]["properties"].update(score={"type": "number"}), "Verdict.score")
        self._changed(lambda m: m["components"]["schemas"]["StartRequest"]["properties"].update(gpus={"type": "integer"}), "StartRequest.gpus")

    def test_a_removed_property_fails(self):
        self._changed(lambda m: m["components"]["schemas"]["CheckpointResult"]["properties"].pop("phases"), "CheckpointResult.phases")

    def test_a_new_operation_fails(self):
        self._changed(
            lambda m: m["paths"].update({"/v1/episodes/{id}/logs": {"get": {"operationId": "getLogs", "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}], "responses": {"200": {"description": "x"}}}}}),
            "getLogs",
        )

    def test_a_removed_operation_fails(self):
        self._changed(lambda m: m["paths"].pop("/v1/checkpoints/{id}/branch"), "branchCheckpoint")

    def test_a_moved_operation_fails(self):
        self._changed(lambda m: m["paths"].update({"/v2/episodes": m["paths"].pop("/v1/episodes")}), "startEpisode")

    def test_a_changed_status_fails(self):
        def change(m):
            r = m["paths"]["/v1/checkpoints"]["post"]["responses"]
            r["200"] = r.pop("201")

        self._changed(change, "createCheckpoint")

    def test_a_new_query_parameter_fails(self):
        self._changed(lambda m: m["paths"]["/v1/episodes"]["get"]["parameters"].append({"name": "limit", "in": "query", "schema": {"type": "integer"}}), "listEpisodes")
        self._changed(lambda m: m["paths"]["/v1/episodes/{id}/ledger"]["get"]["parameters"].pop(), "getLedger")

    def test_a_changed_enum_fails(self):
        self._changed(lambda m: m["components"]["schemas"]["Checkpoint"]["properties"]["state"]["enum"].append("archived"), "Checkpoint.state")

    def test_a_changed_type_fails(self):
        self._changed(lambda m: m["components"]["schemas"]["Episode"]["properties"].update(attempt={"type": "string"}), "Episode.attempt")
        # A property of any JSON value (no type) is Any in the client, and
        # the other way round.
        self._changed(lambda m: m["components"]["schemas"]["LedgerEntry"]["properties"].update(usage={"type": "object"}), "LedgerEntry.usage")
        self._changed(lambda m: m["components"]["schemas"]["LedgerEntry"]["properties"].update(seq={"description": "any"}), "LedgerEntry.seq")
        self._changed(lambda m: m["components"]["schemas"]["LedgerEntry"]["properties"]["request"].pop("nullable"), "LedgerEntry.request")

    def test_json_names(self):
        """A field whose JSON name differs (LedgerEvent.from_ is "from") is
        held to the property of that name."""
        self._changed(lambda m: m["components"]["schemas"]["LedgerEvent"]["properties"].update({"from": {"type": "string"}}), "LedgerEvent.from")
        self._changed(lambda m: m["components"]["schemas"]["LedgerEvent"]["required"].remove("from"), "LedgerEvent.from")

        def renamed(m):
            ev = m["components"]["schemas"]["LedgerEvent"]
            ev["properties"]["from_"] = ev["properties"].pop("from")

        self._changed(renamed, "LedgerEvent.from")

    def test_required_and_nullable_fail(self):
        self._changed(lambda m: m["components"]["schemas"]["CheckpointResult"]["required"].append("continue_error"), "CheckpointResult.continue_error")
        self._changed(lambda m: m["components"]["schemas"]["Episode"]["properties"]["model_calls"].update(nullable=True), "Episode.model_calls")

    def test_a_new_error_type_fails(self):
        def change(m):
            p = m["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["type"]
            p["description"] += ", rate_limited (429)"

        self._changed(change, "error types")

    def test_a_new_schema_fails(self):
        self._changed(lambda m: m["components"]["schemas"].update(Quota={"type": "object", "properties": {"gpus": {"type": "integer"}}}), "Quota")

    def test_an_auth_change_fails(self):
        self._changed(lambda m: m["paths"]["/healthz"]["get"].pop("security"), "healthz")


async def _aio(c, fn):
    async with stasis.AsyncClient(client=c) as ac:
        return await fn(ac)


class WireTest(unittest.TestCase):
    """Each method sends its operation (method, path, query, body,
    headers) and decodes its answer, every declared field of it."""

    spec: dict

    @classmethod
    def setUpClass(cls):
        cls.spec = support.load_spec()

    def client(self, answer, token="tok-1234567890abcdef"):
        c = Client("http://127.0.0.1:9", token=token, retries=0)
        sent = []

        def fake(method, url, data, headers, timeout):
            sent.append((method, url, data, dict(headers), timeout))
            body = answer if isinstance(answer, str) else json.dumps(answer)
            return 200, "application/json", body.encode()

        c._send = fake  # type: ignore[method-assign]
        return c, sent

    def args_for(self, name: str, op, sop: dict) -> tuple[list, dict, dict, dict]:
        """Arguments for the method of op, and what they must become on the
        wire: the path parameters, the query and the body."""
        fn = getattr(Client, op.python)
        hints = typing.get_type_hints(fn)
        params = {p["name"]: p for p in sop.get("parameters", [])}
        args, kw, query, body = [], {}, {}, {}
        for pname, p in inspect.signature(fn).parameters.items():
            if pname == "self":
                continue
            if pname in params and params[pname]["in"] == "path":
                v = "ep-1.x/y z"
                args.append(v)
            elif pname in params and params[pname]["in"] == "query":
                s = params[pname]["schema"]
                v = s["enum"][0] if "enum" in s else {"integer": 5, "boolean": False}.get(s["type"], "v")
                kw[pname] = v
                query[pname] = str(v).lower() if isinstance(v, bool) else str(v)
            else:
                bs = conformance.schema_at(self.spec, op.body.__schema__)["properties"][pname]
                raw = conformance.sample(self.spec, bs)
                v = models.decode(hints[pname], raw)
                if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty:
                    args.append(v)
                else:
                    kw[pname] = v
                body[pname] = raw
        return args, kw, query, body

    def answer_for(self, op, sop):
        status, ctype, schema = conformance.response_of(sop)
        if op.response is str:
            return "ok\n"
        if op.response is dict:
            return {"openapi": "3.0.3"}
        name = conformance.target(schema)
        if op.unwrap:
            items = conformance.schema_at(self.spec, name)["properties"][op.unwrap]["items"]
            return {op.unwrap: [conformance.sample(self.spec, items, op.response.__schema__), conformance.sample(self.spec, items, op.response.__schema__)]}
        return conformance.sample(self.spec, name)

    def assertMatches(self, value, raw, where):
        """value (decoded) holds what raw (JSON) said, field for field."""
        if dataclasses.is_dataclass(value):
            self.assertIsInstance(raw, dict, where)
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if f.metadata.get("extra"):
                    self.assertEqual(v, {}, f"{where}: every sample field is declared, yet extra has {v}")
                    continue
                name = models.json_name(f)
                self.assertIn(name, raw, where)
                self.assertMatches(v, raw[name], f"{where}.{name}")
        elif isinstance(value, list):
            self.assertEqual(len(value), len(raw), where)
            for i, (a, b) in enumerate(zip(value, raw)):
                self.assertMatches(a, b, f"{where}[{i}]")
        elif isinstance(value, dict):
            self.assertEqual(set(value), set(raw), where)
            for k in value:
                self.assertMatches(value[k], raw[k], f"{where}.{k}")
        elif isinstance(value, datetime):
            self.assertEqual(value, models.parse_time(raw), where)
            self.assertIsNotNone(value.tzinfo, where)
        else:
            self.assertEqual(value, raw, where)
            self.assertIs(type(value), float if isinstance(raw, float) else type(raw), where)

    def test_every_method_on_the_wire(self):
        n = 0
        for path, item in self.spec["paths"].items():
            for method, sop in item.items():
                if method not in conformance.METHODS:
                    continue
                op = OPERATIONS[sop["operationId"]]
                with self.subTest(op=op.operation_id):
                    answer = self.answer_for(op, sop)
                    c, sent = self.client(answer)
                    args, kw, query, body = self.args_for(op.python, op, sop)
                    got = getattr(c, op.python)(*args, **kw)
                    self.assertEqual(len(sent), 1)
                    m, url, data, headers, timeout = sent[0]
                    self.assertEqual(m, method.upper())
                    u = urllib.parse.urlsplit(url)
                    want_path = path.replace("{id}", urllib.parse.quote("ep-1.x/y z", safe=""))
                    self.assertEqual(u.path, want_path)
                    self.assertEqual(dict(urllib.parse.parse_qsl(u.query)), query)
                    hdr = {k.lower(): v for k, v in headers.items()}
                    if method == "get":
                        self.assertIsNone(data)
                        self.assertNotIn("content-type", hdr)
                    else:
                        # Every POST (and DELETE) goes as JSON, with a body or without.
                        self.assertEqual(hdr.get("content-type"), "application/json")
                        self.assertEqual(json.loads(data) if data else {}, body)
                    if op.auth:
                        self.assertEqual(hdr.get("authorization"), "Bearer tok-1234567890abcdef")
                    else:
                        self.assertNotIn("authorization", hdr)
                    self.assertEqual(timeout, c.slow_timeout if op.slow else c.timeout)
                    # The answer, decoded.
                    if op.response is str:
                        self.assertIsInstance(got, (str, bool))
                    elif op.response is dict:
                        self.assertEqual(got, answer)
                    elif op.unwrap:
                        self.assertIsInstance(got, list)
                        for x in got:
                            self.assertIsInstance(x, op.response)
                        self.assertMatches(got, answer[op.unwrap], op.operation_id)
                    else:
                        self.assertIsInstance(got, op.response)
                        self.assertMatches(got, answer, op.operation_id)
                    n += 1
        self.assertEqual(n, len(OPERATIONS))

    def test_restore_body_only_when_given(self):
        """restore_checkpoint sends a RestoreRequest only when episodes are
        given (a scoped restore); without them, no body at all."""
        answer = conformance.sample(self.spec, "RestoreResult")
        for call, want in (
            (lambda c: c.restore_checkpoint("ck-1"), None),
            (lambda c: c.restore_checkpoint("ck-1", episodes=("ep-1", "ep-2")), {"episodes": ["ep-1", "ep-2"]}),
            (lambda c: asyncio.run(_aio(c, lambda ac: ac.restore_checkpoint("ck-1", episodes=["ep-3"]))), {"episodes": ["ep-3"]}),
        ):
            c, sent = self.client(answer)
            got = call(c)
            self.assertIsInstance(got, stasis.RestoreResult)
            self.assertIsInstance(got.restore, stasis.Restore)
            self.assertIsInstance(got.shares[0], stasis.RestoreShare)
            (m, url, data, headers, _), = sent
            self.assertEqual((m, urllib.parse.urlsplit(url).path), ("POST", "/v1/checkpoints/ck-1/restore"))
            self.assertEqual(json.loads(data) if data else None, want)
        # An empty list is sent (the server answers 400); one string is a mistake.
        c, sent = self.client(answer)
        c.restore_checkpoint("ck-1", episodes=[])
        self.assertEqual(json.loads(sent[0][2]), {"episodes": []})
        with self.assertRaises(TypeError):
            c.restore_checkpoint("ck-1", episodes="ep-1")

    def test_no_token_no_header(self):
        c = Client("http://127.0.0.1:9", retries=0)
        c.token = None
        sent = []
        c._send = lambda *a: (sent.append(a), (200, "application/json", b'{"checkpoints": []}'))[1]  # type: ignore[method-assign]
        self.assertEqual(c.list_checkpoints(), [])
        self.assertNotIn("Authorization", sent[0][3])

    def test_unknown_fields_are_kept(self):
        raw = conformance.sample(self.spec, "Episode")
        raw["colour"] = "red"
        raw["status"]["new_thing"] = [1, 2]
        ep = models.decode(stasis.Episode, raw)
        self.assertEqual(ep.extra, {"colour": "red"})
        self.assertEqual(ep.status.extra, {"new_thing": [1, 2]})

    def test_json_name_decode_encode(self):
        raw = {"line": 4, "kind": "cut", "to": 2, "from": 5, "reason": "relaunch", "boundary": True, "at": "2026-01-02T03:04:05Z"}
        ev = models.decode(stasis.LedgerEvent, raw)
        self.assertEqual((ev.from_, ev.to, ev.extra), (5, 2, {}))
        out = models.encode(ev)
        self.assertEqual(out["from"], 5)
        self.assertNotIn("from_", out)
        # A field's own name is not its JSON name: it is kept as unknown.
        self.assertEqual(models.decode(stasis.LedgerEvent, dict(raw, from_=9)).extra, {"from_": 9})

    def test_ledger_pages(self):
        """Client.ledger reads page after page (after = the last seq) until
        more is false, and gives them as one Ledger."""

        def entry(seq):
            e = conformance.sample(self.spec, "LedgerEntry")
            e.update(seq=seq, call_id=f"ep/{seq}", tokens={"prompt_token_ids": [1], "completion_token_ids": [seq, seq], "logprobs": [-0.5, -0.25]})
            return e

        def page(entries, more, events=0):
            p = conformance.sample(self.spec, "Ledger")
            ev = conformance.sample(self.spec, "LedgerEvent")
            p.update(entries=entries, more=more, live=5, events=[ev] * events, dropped=[])
            return p

        pages = {0: page([entry(1), entry(2)], True), 2: page([entry(3), entry(4)], True), 4: page([entry(5)], False)}
        c = Client("http://127.0.0.1:9", retries=0)
        sent = []

        def fake(method, url, data, headers, timeout):
            q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
            sent.append(q)
            return 200, "application/json", json.dumps(pages[int(q.get("after", 0))]).encode()

        c._send = fake  # type: ignore[method-assign]
        led = c.ledger("ep", bodies=False)
        self.assertEqual([q.get("after") for q in sent], [None, "2", "4"])
        self.assertTrue(all(q["bodies"] == "false" for q in sent))
        self.assertEqual([e.seq for e in led.entries], [1, 2, 3, 4, 5])
        self.assertFalse(led.more)
        self.assertEqual(led.token_count, 10)
        self.assertEqual(led.completion_token_ids(), [1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
        self.assertEqual(len(led.logprobs()), 10)

        # A cut between two pages (a new event): read again from the start.
        sent.clear()
        calls = {"n": 0}
        first, cut = pages[0], page([entry(1), entry(2)], True, events=1)

        def fake_cut(method, url, data, headers, timeout):
            q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
            calls["n"] += 1
            sent.append(q)
            if calls["n"] == 1:
                return 200, "application/json", json.dumps(first).encode()
            after = int(q.get("after", 0))
            body = cut if after == 0 else page([entry(3)], False, events=1)
            return 200, "application/json", json.dumps(body).encode()

        c._send = fake_cut  # type: ignore[method-assign]
        led = c.ledger("ep")
        self.assertEqual([q.get("after") for q in sent], [None, "2", None, "2"])
        self.assertEqual([e.seq for e in led.entries], [1, 2, 3])

    def test_go_enum_zero_value_is_none(self):
        raw = conformance.sample(self.spec, "SupervisorStatus")
        raw["mode"] = ""
        self.assertIsNone(models.decode(stasis.SupervisorStatus, raw).mode)

    def test_times(self):
        t = models.parse_time("2026-12-06T04:40:10.903573162Z")
        self.assertEqual((t.year, t.microsecond, t.utcoffset().total_seconds()), (2026, 903573, 0))
        t = models.parse_time("2026-12-06T04:40:10+02:00")
        self.assertEqual(t.utcoffset().total_seconds(), 7200)
        with self.assertRaises(ValueError):
            models.parse_time("yesterday")

    def test_addresses(self):
        from stasis.client import _parse_address

        self.assertEqual(_parse_address("127.0.0.1:8080"), ("http://127.0.0.1:8080", None))
        self.assertEqual(_parse_address("unix:/run/s/api.sock"), ("http://localhost", "/run/s/api.sock"))
        self.assertEqual(_parse_address("unix:///run/s/api.sock"), ("http://localhost", "/run/s/api.sock"))
        self.assertEqual(_parse_address("https://h:8443/"), ("https://h:8443", None))
        with self.assertRaises(ValueError):
            _parse_address("ftp://h")


if __name__ == "__main__":
    unittest.main()
