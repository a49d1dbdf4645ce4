"""TEI's published OpenAPI description (tests/serve/data/tei-openapi-1.7.1.json, see the README
there) as checks: a request the tests send as valid must fit the route's request schema, and an
answer must carry a status the route documents and fit that status's schema.

The description is OpenAPI 3.0, whose schemas are JSON Schema but for ``nullable``; this turns
``nullable: true`` into JSON Schema's ``null`` type and validates with ``jsonschema``."""

from __future__ import annotations

import json
import os

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the contract tests' validator) is not installed")

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tei-openapi-1.7.1.json")
with open(PATH) as f:
    SPEC = json.load(f)
VERSION = SPEC["info"]["version"]

#: Statuses TEI's own router answers on a route whose description leaves them out (its 413 on too
#: many inputs to /tokenize and /decode: ``ErrorType::Validation`` is 413 everywhere in its router).
UNDOCUMENTED = {("/tokenize", 413), ("/decode", 413)}


def _json_schema(node):
    """An OpenAPI 3.0 schema as JSON Schema: ``nullable: true`` admits null."""
    if isinstance(node, list):
        return [_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


COMPONENTS = _json_schema(SPEC["components"])


def _validate(schema: dict, instance, what: str) -> None:
    root = {**_json_schema(schema), "components": COMPONENTS}
    errors = sorted(jsonschema.Draft202012Validator(root).iter_errors(instance), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        raise AssertionError(
            f"{what} does not fit TEI {VERSION}'s schema at {list(e.absolute_path)}: {e.message}\n"
            f"{json.dumps(instance)[:600]}"
        )


def operation(route: str, method: str = "post") -> dict:
    assert route in SPEC["paths"] and method in SPEC["paths"][route], f"TEI {VERSION} has no {method.upper()} {route}"
    return SPEC["paths"][route][method]


def check_request(route: str, body) -> None:
    """``body`` fits ``route``'s request schema (so a test's "valid request" is one by the contract)."""
    schema = operation(route)["requestBody"]["content"]["application/json"]["schema"]
    _validate(schema, body, f"the request to {route}")


def check_response(route: str, response, method: str = "post") -> None:
    """``response`` (an httpx response) has a status ``route`` documents and fits its schema."""
    status = response.status_code
    documented = operation(route, method)["responses"]
    if str(status) not in documented:
        assert (route, status) in UNDOCUMENTED, (
            f"{method.upper()} {route} answered {status}; TEI {VERSION} "
            f"documents {sorted(documented)}: {response.text[:300]}"
        )
        return
    content = documented[str(status)].get("content", {})
    if "application/json" in content:
        assert response.headers["content-type"].startswith("application/json"), response.headers
        _validate(content["application/json"]["schema"], response.json(), f"{method.upper()} {route}'s {status}")
    elif "text/plain" in content:
        assert response.headers["content-type"].startswith("text/plain"), response.headers


def post(client, route: str, body, *, valid: bool = True, path: str | None = None):
    """POST ``body`` to ``route`` (or ``path``, an alias answering as ``route``), checking the request
    against the contract when ``valid`` and the answer always; returns the response."""
    if valid:
        check_request(route, body)
    r = client.post(path or route, json=body)
    check_response(route, r)
    return r
