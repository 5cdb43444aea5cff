"""A client's mistake in a query or a URL over real HTTP (no worker needed): a bad ``limit`` or ``order`` of
``GET /v1/responses/{id}/input_items`` is a 400 naming it, as on files and batches, never a 500; and under
``/v1`` the API key is checked first: an unknown path or method answers 401 without a key and 403 with an
operator key, 404/405 only with an API key (issue 54, item 8)."""

from __future__ import annotations

import hashlib
import logging

import httpx
import pytest

KEY = "sk-" + "k" * 29
OPERATOR = "op-" + "o" * 29
BAD = ["abc", "1e3", "1.5", "", "0", "-1", "²", "9" * 30]
BAD_ORDER = ["ASC", "", "up", "desc "]


def stored(gw) -> str:
    """A stored response of KEY's (written straight to the store: no fleet needed), its id."""
    owner = hashlib.sha256(KEY.encode()).hexdigest()[:32]
    done = {"id": "resp_q1", "object": "response", "output": []}
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}]
    gw.run(gw.app.state.redis.responses.save(owner, done, messages))
    return done["id"]


def test_bad_list_queries_are_400s_naming_the_parameter(start_gateway, tmp_path, caplog):
    gw = start_gateway(api_keys=(KEY,), files_dir=str(tmp_path / "files"))
    rid = stored(gw)
    caplog.set_level(logging.ERROR, logger="batchfleet")
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        items = http.get(f"/v1/responses/{rid}/input_items", params={"limit": "1", "order": "asc"})
        assert items.status_code == 200 and len(items.json()["data"]) == 1 and items.json()["has_more"]
        for path in (f"/v1/responses/{rid}/input_items", "/v1/responses/resp_none/input_items",
                     "/v1/files", "/v1/batches"):
            for value in BAD:
                resp = http.get(path, params={"limit": value})
                assert resp.status_code == 400, (path, value, resp.text)
                assert resp.json()["error"]["param"] == "limit" and resp.json()["error"]["type"] == (
                    "invalid_request_error")
        assert http.get(f"/v1/responses/{rid}/input_items", params={"limit": "101"}).status_code == 400
        for value in BAD_ORDER:
            resp = http.get(f"/v1/responses/{rid}/input_items", params={"order": value})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "order", (value, resp.text)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback: nothing failed


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/nowhere"), ("POST", "/v1/chat/completion"), ("GET", "/v1"), ("GET", "/v1/"),
    ("DELETE", "/v1/chat/completions"), ("PUT", "/v1/files"), ("GET", "/v1/embeddings"),
])
def test_unknown_paths_and_methods_under_v1_check_the_key_first(start_gateway, method, path):
    gw = start_gateway(api_keys=(KEY,), operator_keys=(OPERATOR,))
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        none = http.request(method, path)
        assert none.status_code == 401 and none.json()["error"]["code"] == "invalid_api_key", none.text
        wrong = http.request(method, path, headers={"Authorization": "Bearer sk-wrong-wrong-wrong-wrong-wrong"})
        assert wrong.status_code == 401, wrong.text
        operator = http.request(method, path, headers={"Authorization": f"Bearer {OPERATOR}"})
        assert operator.status_code == 403 and operator.json()["error"]["code"] == "operator_key_read_only"
        keyed = http.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code in (404, 405) and "this gateway serves" in keyed.json()["error"]["message"]
        assert http.get("/nowhere").status_code == 404  # outside the API: no key asked
