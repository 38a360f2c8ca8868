"""The client against openapi/server.json: every operation, every field of
the schemas the dataclasses mirror, and what each method puts on the wire.
No server needed."""

from __future__ import annotations

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
        self.assertGreaterEqual(len(ops), 14)

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
            lambda m: m["paths"].update({"/v1/episodes/{id}/ledger": {"get": {"operationId": "getLedger", "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}], "responses": {"200": {"description": "x"}}}}}),
            "getLedger",
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

    def test_a_changed_enum_fails(self):
        self._changed(lambda m: m["components"]["schemas"]["Checkpoint"]["properties"]["state"]["enum"].append("archived"), "Checkpoint.state")

    def test_a_changed_type_fails(self):
        self._changed(lambda m: m["components"]["schemas"]["Episode"]["properties"].update(attempt={"type": "string"}), "Episode.attempt")

    def test_required_and_nullable_fail(self):
        self._changed(lambda m: m["components"]["schemas"]["CheckpointResult"]["required"].append("continue_error"), "CheckpointResult.continue_error")
        self._changed(lambda m: m["components"]["schemas"]["Episode"]["properties"]["model_calls"].update(nullable=True), "Episode.model_calls")

    def test_a_new_error_type_fails(self):
        def change(m):
            p = m["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["type"]
            p["description"] += ", rate_limited (429)"

        self._changed(change, "error types")

    def test_a_new_schema_fails(self):
        self._changed(lambda m: m["components"]["schemas"].update(LedgerEntry={"type": "object", "properties": {"seq": {"type": "integer"}}}), "LedgerEntry")

    def test_an_auth_change_fails(self):
        self._changed(lambda m: m["paths"]["/healthz"]["get"].pop("security"), "healthz")


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
                v = s["enum"][0] if "enum" in s else (5 if s["type"] == "integer" else "v")
                kw[pname] = v
                query[pname] = str(v)
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
                self.assertIn(f.name, raw, where)
                self.assertMatches(v, raw[f.name], f"{where}.{f.name}")
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

    def test_no_token_no_header(self):
        c = Client("http://127.0.0.1:9", retries=0)
        c.token = None
        sent = []
        c._send = lambda *a: (sent.append(a), (200, "application/json", b'{"checkpoints": []}'))[1]  # type: ignore[method-assign]
        self.assertEqual(c.list_checkpoints(), [])
        self.assertNotIn("Authorization", sent[0][3])

    def test_unknown_fields_are_kept(self):
        raw = conformance.sample(self.spec, "Episode")
        raw["environment"] = "host"
        raw["status"]["new_thing"] = [1, 2]
        ep = models.decode(stasis.Episode, raw)
        self.assertEqual(ep.extra, {"environment": "host"})
        self.assertEqual(ep.status.extra, {"new_thing": [1, 2]})

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
