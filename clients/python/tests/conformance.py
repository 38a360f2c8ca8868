"""The client held to internal/control/openapi/server.json.

``problems(spec)`` lists every way the client differs from an OpenAPI
document: an operation it lacks or has too many, a method, path, status,
body, query parameter or answer that differs, a dataclass field that a
schema lacks or the other way round, a type, an enum, a required or
nullable property that the dataclass does not follow, a schema no
dataclass mirrors, an error type the errors module lacks. A field stands
for the property of its JSON name (models.json_name: its own name, or
metadata={"json": ...}); a property of any JSON value (no type) is Any. An
empty list is conformance; the tests also feed it altered documents to see
it complain.

``undeclared(spec, schema, value)`` lists the keys of a JSON answer its
schema does not declare, for the live tests.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from datetime import datetime
from typing import Any, Literal, Optional

import stasis
from stasis import models
from stasis.aio import AsyncClient
from stasis.client import OPERATIONS, Client
from stasis.errors import ERROR_TYPES

METHODS = ("get", "post", "put", "patch", "delete", "head", "options")

# The dataclasses that mirror a schema (by their __schema__).
MODELS: list[type] = [
    c for c in vars(models).values() if isinstance(c, type) and dataclasses.is_dataclass(c) and hasattr(c, "__schema__")
]


def ref_name(ref: str) -> str:
    prefix = "#/components/schemas/"
    if not ref.startswith(prefix):
        raise ValueError(f"unsupported $ref {ref}")
    return ref[len(prefix) :]


def schema_at(spec: dict, name: str) -> Optional[dict]:
    """A component schema by name; "A.b" is property b of A (an inline
    object, or the items of an array property)."""
    parts = name.split(".")
    s = spec.get("components", {}).get("schemas", {}).get(parts[0])
    for p in parts[1:]:
        if s is None:
            return None
        s = s.get("properties", {}).get(p)
        if s is not None and s.get("type") == "array":
            s = s.get("items")
    return s


def target(prop: dict) -> Optional[str]:
    """The schema a property refers to ($ref, or allOf of one $ref)."""
    if "$ref" in prop:
        return ref_name(prop["$ref"])
    all_of = prop.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and "$ref" in all_of[0]:
        return ref_name(all_of[0]["$ref"])
    return None


def split_optional(tp: Any) -> tuple[Any, bool]:
    if models._is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        opt = len(args) < len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), opt
    return tp, False


def check_type(tp: Any, prop: dict, where: str, owner: str) -> list[str]:
    """Whether annotation tp (without Optional) speaks schema prop."""
    out: list[str] = []
    t = target(prop)
    if t is None and "type" not in prop and "enum" not in prop:
        # Any JSON value (no type): Any, or Optional[Any] when nullable
        # (split_optional took the None off).
        if tp is not Any:
            out.append(f"{where}: any JSON value in the schema (no type), {tp!r} in the client (want Any)")
        return out
    if t is not None:
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp) and getattr(tp, "__schema__", None) == t):
            out.append(f"{where}: the schema refers to {t}, the client has {tp!r}")
        return out
    if "enum" in prop:
        if typing.get_origin(tp) is not Literal:
            out.append(f"{where}: the schema has enum {prop['enum']}, the client has {tp!r} (want a Literal)")
        elif set(typing.get_args(tp)) != set(prop["enum"]):
            out.append(f"{where}: enum {sorted(map(str, prop['enum']))} in the schema, {sorted(map(str, typing.get_args(tp)))} in the client")
        return out
    typ = prop.get("type")
    simple = {"integer": int, "number": float, "boolean": bool}
    if typ == "string":
        want = datetime if prop.get("format") == "date-time" else str
        if tp is not want:
            out.append(f"{where}: a {typ}{' date-time' if want is datetime else ''} in the schema, {tp!r} in the client")
    elif typ in simple:
        if tp is not simple[typ]:
            out.append(f"{where}: a {typ} in the schema, {tp!r} in the client")
    elif typ == "array":
        if typing.get_origin(tp) is not list:
            out.append(f"{where}: an array in the schema, {tp!r} in the client")
        else:
            (item,) = typing.get_args(tp)
            items = prop.get("items", {})
            if items.get("type") == "object" and items.get("properties"):
                if getattr(item, "__schema__", None) != owner:
                    out.append(f"{where}[]: an inline object in the schema; the client's items are {item!r}, not a dataclass with __schema__ {owner!r}")
            else:
                out += check_type(item, items, where + "[]", owner)
    elif typ == "object":
        if prop.get("properties"):
            if getattr(tp, "__schema__", None) != owner:
                out.append(f"{where}: an inline object in the schema; the client has {tp!r}, not a dataclass with __schema__ {owner!r}")
        else:
            if typing.get_origin(tp) is not dict or typing.get_args(tp)[0] is not str:
                out.append(f"{where}: an object (map) in the schema, {tp!r} in the client")
            else:
                ap = prop.get("additionalProperties")
                if isinstance(ap, dict) and ap:
                    out += check_type(typing.get_args(tp)[1], ap, where + "{}", owner + ".*")
                elif typing.get_args(tp)[1] is not Any:
                    out.append(f"{where}: a free-form object in the schema, {tp!r} in the client (want dict[str, Any])")
    else:
        out.append(f"{where}: the schema's type {typ!r} is one this check does not know")
    return out


def model_problems(spec: dict, cls: type) -> list[str]:
    name = cls.__schema__
    schema = schema_at(spec, name)
    if schema is None:
        return [f"{cls.__name__} mirrors {name}, which the document does not have"]
    out: list[str] = []
    props: dict = schema.get("properties", {})
    required = set(schema.get("required", []))
    # Fields by the JSON name they stand for (models.json_name).
    fields = {models.json_name(f): f for f in dataclasses.fields(cls)}
    extra = [f for f in fields.values() if f.metadata.get("extra")]
    plain = {n: f for n, f in fields.items() if not f.metadata.get("extra")}
    for n in sorted(set(props) - set(plain)):
        out.append(f"{name}.{n}: in the document, not in {cls.__name__}")
    for n in sorted(set(plain) - set(props)):
        out.append(f"{name}.{n}: in {cls.__name__}, not in the document")
    if schema.get("additionalProperties") is False:
        if extra:
            out.append(f"{name}: the document allows no other properties, {cls.__name__} keeps them in {extra[0].name}")
    elif not extra:
        out.append(f"{name}: other properties may come, and {cls.__name__} has no extra field to keep them")
    hints = models.type_hints(cls)
    for n in sorted(set(props) & set(plain)):
        f, prop = plain[n], props[n]
        where = f"{name}.{n}"
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if n in required and has_default:
            out.append(f"{where}: required in the document, has a default in {cls.__name__}")
        if n not in required and not has_default:
            out.append(f"{where}: optional in the document, required in {cls.__name__}")
        base, optional = split_optional(hints[f.name])
        nullable = bool(prop.get("nullable"))
        if nullable and not optional:
            out.append(f"{where}: nullable in the document, not Optional in {cls.__name__}")
        if n in required and not nullable and optional:
            out.append(f"{where}: required and not nullable in the document, Optional in {cls.__name__}")
        out += check_type(base, prop, where, f"{name}.{n}")
    return out


def response_of(op: dict) -> tuple[int, Optional[str], Optional[dict]]:
    """The success status, its content type and schema."""
    codes = [c for c in op.get("responses", {}) if str(c).startswith("2")]
    if len(codes) != 1:
        return (0, None, None)
    r = op["responses"][codes[0]]
    content = r.get("content", {})
    if not content:
        return (int(codes[0]), None, None)
    ctype = next(iter(content))
    return int(codes[0]), ctype, content[ctype].get("schema", {})


def operation_problems(spec: dict) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for path, item in spec.get("paths", {}).items():
        for method in METHODS:
            sop = item.get(method)
            if sop is None:
                continue
            oid = sop.get("operationId", f"{method.upper()} {path}")
            seen.add(oid)
            op = OPERATIONS.get(oid)
            where = f"{oid} ({method.upper()} {path})"
            if op is None:
                out.append(f"{where}: in the document, the client has no such operation")
                continue
            if (op.method, op.path) != (method.upper(), path):
                out.append(f"{where}: the client sends {op.method} {op.path}")
            status, ctype, schema = response_of(sop)
            if status != op.status:
                out.append(f"{where}: answers {status}, the client expects {op.status}")
            auth = sop.get("security", spec.get("security")) != []
            if auth != op.auth:
                out.append(f"{where}: needs credentials: {auth}; the client sends the token: {op.auth}")
            params = [p for p in item.get("parameters", []) + sop.get("parameters", [])]
            query = {p["name"] for p in params if p.get("in") == "query"}
            if query != set(op.query):
                out.append(f"{where}: query parameters {sorted(query)} in the document, {sorted(op.query)} in the client")
            in_path = {p["name"] for p in params if p.get("in") == "path"}
            if in_path != set(re.findall(r"{(\w+)}", path)):
                out.append(f"{where}: path parameters {sorted(in_path)} do not match the path (a document error)")
            rb = sop.get("requestBody")
            body_props: set[str] = set()
            if rb is None:
                if op.body is not None:
                    out.append(f"{where}: takes no body, the client sends {op.body.__name__}")
            else:
                bschema = rb.get("content", {}).get("application/json", {}).get("schema", {})
                bname = target(bschema)
                if op.body is None or getattr(op.body, "__schema__", None) != bname:
                    out.append(f"{where}: takes a {bname} body, the client sends {op.body!r}")
                if bool(rb.get("required")) != op.body_required:
                    out.append(f"{where}: body required: {bool(rb.get('required'))} in the document, {op.body_required} in the client")
                body_props = set((schema_at(spec, bname) or {}).get("properties", {})) if bname else set()
            # The answer.
            if ctype == "text/plain":
                if op.response is not str:
                    out.append(f"{where}: answers text, the client decodes {op.response!r}")
            elif ctype == "application/json":
                rname = target(schema or {})
                if rname is None:
                    if op.response is not dict:
                        out.append(f"{where}: answers a free-form JSON object, the client decodes {op.response!r}")
                elif op.unwrap is not None:
                    wrapper = schema_at(spec, rname) or {}
                    arr = wrapper.get("properties", {}).get(op.unwrap)
                    if arr is None or arr.get("type") != "array" or set(wrapper.get("properties", {})) != {op.unwrap}:
                        out.append(f"{where}: the client takes the answer ({rname}) as {{{op.unwrap}: [...]}}, the document says otherwise")
                    else:
                        items = arr.get("items", {})
                        iname = target(items) or f"{rname}.{op.unwrap}"
                        if getattr(op.response, "__schema__", None) != iname:
                            out.append(f"{where}: answers {rname}.{op.unwrap}[] of {iname}, the client decodes {op.response!r}")
                elif getattr(op.response, "__schema__", None) != rname:
                    out.append(f"{where}: answers {rname}, the client decodes {op.response!r}")
            else:
                out.append(f"{where}: answers {ctype!r}, which the client does not decode")
            # The methods: Client's and AsyncClient's, with the same
            # parameters: the path's, the query's and the body's.
            fn = getattr(Client, op.python, None)
            afn = getattr(AsyncClient, op.python, None)
            if fn is None or afn is None:
                out.append(f"{where}: Client.{op.python} or AsyncClient.{op.python} is missing")
                continue
            if not inspect.iscoroutinefunction(afn):
                out.append(f"{where}: AsyncClient.{op.python} is not a coroutine")
            names = [p for p in inspect.signature(fn).parameters if p != "self"]
            anames = [p for p in inspect.signature(afn).parameters if p != "self"]
            if names != anames:
                out.append(f"{where}: Client.{op.python}{names} and AsyncClient.{op.python}{anames} differ")
            want = in_path | query | body_props
            if set(names) != want:
                out.append(f"{where}: Client.{op.python} takes {sorted(names)}, the operation {sorted(want)}")
    for oid in sorted(set(OPERATIONS) - seen):
        op = OPERATIONS[oid]
        out.append(f"{oid} ({op.method} {op.path}): in the client, not in the document")
    return out


def error_problems(spec: dict) -> list[str]:
    out: list[str] = []
    desc = (schema_at(spec, "Error.error") or {}).get("properties", {}).get("type", {}).get("description", "")
    # "not_found (404)", or with a note: "not_found (404: also ...)".
    listed = {t: int(s) for t, s in re.findall(r"(\w+) \((\d{3})[):]", desc)}
    mine = {t: s for t, (s, _) in ERROR_TYPES.items()}
    if listed != mine:
        out.append(f"error types: the document lists {listed}, the client knows {mine}")
    statuses = set(mine.values())
    for path, item in spec.get("paths", {}).items():
        for method in METHODS:
            sop = item.get(method)
            for code in (sop or {}).get("responses", {}):
                if str(code)[0] in "45" and int(code) not in statuses:
                    out.append(f"{method.upper()} {path}: answers {code}, which no error class of the client names")
    return out


def coverage_problems(spec: dict) -> list[str]:
    """Every schema is mirrored: by a dataclass, as an answer the client
    unwraps, or (Error) by the errors module."""
    mirrored = {c.__schema__.split(".")[0] for c in MODELS}
    wrappers = set()
    for path, item in spec.get("paths", {}).items():
        for method in METHODS:
            sop = item.get(method)
            if sop and sop.get("operationId") in OPERATIONS and OPERATIONS[sop["operationId"]].unwrap:
                _, _, s = response_of(sop)
                if s and target(s):
                    wrappers.add(target(s))
    out = []
    for name in spec.get("components", {}).get("schemas", {}):
        if name not in mirrored and name not in wrappers and name != "Error":
            out.append(f"schema {name}: no dataclass of the client mirrors it")
    return out


def problems(spec: dict) -> list[str]:
    out = operation_problems(spec) + error_problems(spec) + coverage_problems(spec)
    for cls in MODELS:
        out += model_problems(spec, cls)
    return out


# --- answers ----------------------------------------------------------------


def undeclared(spec: dict, schema: Any, value: Any, where: str = "") -> list[str]:
    """The properties of value (a decoded JSON answer) that its schema,
    followed into every nested object, does not declare, each as
    SCHEMA.property (SCHEMA the innermost named schema, or SCHEMA.prop for an
    inline object); a schema with additionalProperties true declares any."""
    if isinstance(schema, str):
        where, schema = schema, schema_at(spec, schema) or {}
    t = target(schema)
    if t is not None:
        return undeclared(spec, t, value)
    out: list[str] = []
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        props = schema.get("properties", {})
        ap = schema.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                out += undeclared(spec, props[k], v, f"{where}.{k}")
            elif isinstance(ap, dict) and ap:
                out += undeclared(spec, ap, v, f"{where}.*")
            elif ap is not True and props:
                out.append(f"{where}.{k}")
    elif isinstance(value, list) and schema.get("type") == "array":
        for v in value:
            out += undeclared(spec, schema.get("items", {}), v, where)
    return out


def sample(spec: dict, schema: Any, owner: str = "") -> Any:
    """A JSON value of every declared property of schema (for the decode
    tests)."""
    if isinstance(schema, str):
        return sample(spec, schema_at(spec, schema) or {}, schema)
    t = target(schema)
    if t is not None:
        return sample(spec, schema_at(spec, t) or {}, t)
    if "enum" in schema:
        return schema["enum"][-1]
    typ = schema.get("type", "object")
    if typ == "string":
        return "2026-01-02T03:04:05.123456789Z" if schema.get("format") == "date-time" else f"s-{owner}"
    if typ == "integer":
        return 7
    if typ == "number":
        return 2.5
    if typ == "boolean":
        return True
    if typ == "array":
        return [sample(spec, schema.get("items", {}), owner)]
    props = schema.get("properties", {})
    if props:
        return {k: sample(spec, v, f"{owner}.{k}") for k, v in props.items()}
    ap = schema.get("additionalProperties")
    if isinstance(ap, dict) and ap:
        return {"k": sample(spec, ap, owner)}
    return {"free": "form"}
