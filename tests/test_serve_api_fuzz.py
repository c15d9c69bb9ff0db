"""Property-based API tests: Schemathesis generates requests from the server's own OpenAPI document.

For every route, valid and invalid bodies alike: no 5xx, every answer matches the schema the document
declares for its status (streamed bodies aside), and a request without the key, or with a wrong one, is
401 whatever its body. The tiny model keeps a run within the CI ceiling (bounded examples per route).
"""

from __future__ import annotations

import copy

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import write_tiny_adapter
from emotune.core.config.load import load_config
from emotune.serve import build_engine, create_app
from server_harness import running
from test_serve import ADMIN_AUTH, AUTH, serve_config

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    write_tiny_adapter(tiny_model_dir, root / "tiny")
    cfg = load_config(None, ["device=cpu", f"model.source={tiny_model_dir}"])
    engine, _ = build_engine(cfg, [str(root / "tiny")])
    with running(create_app(engine, serve_config(root))) as (url, _):
        yield url


def api_document(cfg) -> dict:
    """The OpenAPI document of an app with this config. It depends on the routes and the config alone, not
    on the weights, so it is built at collection time without a model (Schemathesis' fixture-based loader
    does not run under pytest 9); `test_the_fuzzed_document_is_the_one_served` holds the two equal."""
    return create_app(None, cfg).openapi()


def aimed_at_the_served_models(document: dict) -> dict:
    """A copy whose `model` fields name the served models, and whose chats are one user message, so that
    generated bodies reach the model instead of stopping at 404 or at the chat template's 422 (other
    names and roles are still tried through the negative cases)."""
    document = copy.deepcopy(document)
    message = document["components"]["schemas"]["ChatMessage"]["properties"]
    message["role"] = {"type": "string", "enum": ["user"]}
    document["components"]["schemas"]["ChatRequest"]["properties"]["messages"].update(minItems=1, maxItems=1)
    for body in ("ClassifyRequest", "ChatRequest"):
        body_schema = document["components"]["schemas"][body]
        body_schema["properties"]["model"]["enum"] = ["tiny", "base"]
        for example in body_schema.get("examples", []):
            example["model"] = "tiny"
    return document


DOCUMENT = api_document(serve_config("unused"))
schema = schemathesis.openapi.from_dict(aimed_at_the_served_models(DOCUMENT))


def without_key(case, served: str, headers: dict[str, str]) -> httpx.Response:
    """The generated request as it was sent, but with `headers` in place of the key."""
    kwargs = case.as_transport_kwargs(base_url=served)
    sent = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "authorization"}
    return httpx.request(kwargs["method"], kwargs["url"], headers={**sent, **headers}, params=kwargs.get("params"),
                         content=_content(kwargs), timeout=60)


def _content(kwargs: dict):
    import json

    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    return kwargs.get("data")


def test_the_fuzzed_document_is_the_one_served(served):
    assert httpx.get(served + "/openapi.json", headers=AUTH).json() == DOCUMENT


@pytest.mark.slow  # about a minute on 2 CPU cores (with OMP_NUM_THREADS=1 on a shared machine)
@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_declared_answers_and_keys_before_bodies(case, served):
    key = ADMIN_AUTH if case.path.startswith("/v1/adapters") else AUTH
    response = case.call(base_url=served, headers=key, timeout=60)
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert response.status_code == 200  # a stream's events are not one JSON document
    else:
        case.validate_response(response, checks=CHECKS, headers=key)
    if case.path != "/health":
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = without_key(case, served, headers)
            assert refused.status_code == 401, (case.method, case.path, refused.text)
            assert refused.json()["error"]["code"] == 401
