"""schemathesis against the running server's own OpenAPI schema: for every operation, a bounded number of generated
requests (valid by the schema, and not), each answered without a 5xx, with a documented status and content type, and
with a body that matches the schema of that status."""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.serving.conftest import API_KEY, MODEL

EXAMPLES = int(os.environ.get("FXLLM_FUZZ_EXAMPLES", 20))  # per operation and mode: seconds on the tiny model
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}"), ("GET", "/health"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.root}/openapi.json")


def test_schema_lists_every_route(schema):
    listed = {(operation.ok().method.upper(), operation.ok().path) for operation in schema.get_all_operations()}
    assert listed == set(OPERATIONS)


CASES = [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS] + \
    [(method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST"]


@pytest.mark.parametrize("method, path, mode", CASES)
def test_fuzz(schema, server, method, path, mode):
    """Positive cases fit the schema (the engine may still refuse their values: 400) and name the served model (a
    random name is a 404 and nothing more), negative ones do not fit it."""
    operation = schema[path][method]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    statuses = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case):
        if mode == GenerationMode.POSITIVE:
            if isinstance(case.body, dict):
                case.body["model"] = MODEL
            if case.path_parameters:
                case.path_parameters["model"] = MODEL
        response = case.call(base_url=server.root, headers=headers, timeout=60)
        case.validate_response(response, checks=CHECKS)
        statuses.append(response.status_code)

    check()
    print(method, path, mode.value, sorted(Counter(statuses).items()))
    assert statuses and httpx.get(f"{server.root}/health").status_code == 200
