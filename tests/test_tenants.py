"""Tenants' settings, files, headers and usage tables (common/tenants.py), the gateway's tenant keys and tenant
gauges: pure, no Redis."""

from __future__ import annotations

import json

import pytest

from batchfleet.common.errors import ConfigError, RateLimited
from batchfleet.common.tenants import (
    Tenant,
    Window,
    duration_text,
    estimated_tokens,
    metric_label,
    parse_tenants,
    read_tenants_file,
    render_usage,
    too_large_text,
    usage_rows,
    usage_table,
    utc_day,
    window_of,
)

pytestmark = pytest.mark.unit


def test_tenant_settings_are_checked_with_a_clear_error():
    t = Tenant("acme", weight=3, requests_per_minute=60)
    assert t.weight == 3.0 and t.limited and t.settings() == {"weight": 3.0, "requests_per_minute": 60}
    assert not Tenant("beta").limited and Tenant("beta").settings() == {"weight": 1.0}
    for bad, said in [({"label": "Acme"}, "label"), ({"label": "x" * 33}, "label"), ({"label": ""}, "label"),
                      ({"label": "a", "weight": 0}, "weight"), ({"label": "a", "weight": float("nan")}, "weight"),
                      ({"label": "a", "weight": True}, "weight"),
                      ({"label": "a", "requests_per_minute": 0}, "requests"),
                      ({"label": "a", "tokens_per_day": 1.5}, "tokens_per_day"),
                      ({"label": "a", "tokens_per_day": 2**64}, r"tokens_per_day must be a whole number in \[1, ")]:
        with pytest.raises(ConfigError, match=said):
            Tenant(**bad)
    for reserved in ("default", "other"):  # what metrics call the default tenant and the ones not configured
        with pytest.raises(ConfigError, match="reserved"):
            Tenant(reserved, requests_per_minute=5)
    with pytest.raises(ConfigError, match="unknown setting.*rpm"):
        Tenant.of("a", {"rpm": 3})
    assert Tenant.decode(b"acme", json.dumps(t.settings())) == t
    with pytest.raises(ConfigError, match="tenant label must be"):  # a hand-written label, not even UTF-8
        Tenant.decode(b"\xff", "{}")


def test_tenants_files_in_every_format(tmp_path):
    want = [Tenant("acme", 3, 60), Tenant("beta", 1, tokens_per_day=1000)]
    (tmp_path / "t.yaml").write_text("tenants:\n  acme: {weight: 3, requests_per_minute: 60}\n"
                                     "  beta: {tokens_per_day: 1000}\n")
    (tmp_path / "t.json").write_text(json.dumps({"acme": {"weight": 3, "requests_per_minute": 60},
                                                 "beta": {"tokens_per_day": 1000}}))
    (tmp_path / "t.toml").write_text("[acme]\nweight = 3\nrequests_per_minute = 60\n[beta]\ntokens_per_day = 1000\n")
    for name in ("t.yaml", "t.json", "t.toml"):
        assert read_tenants_file(tmp_path / name) == want, name
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="bad.json is not valid JSON"):
        read_tenants_file(tmp_path / "bad.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{")  # not UTF-8: one clear error, not a traceback
    with pytest.raises(ConfigError, match="binary.json cannot be read as UTF-8 text"):
        read_tenants_file(tmp_path / "binary.json")
    with pytest.raises(ConfigError, match="tenant beta: weight"):
        parse_tenants({"beta": {"weight": -1}})


def test_reset_durations_read_as_openais():
    assert [duration_text(s) for s in (0, 0.0201, 1.0, 1.55, 59.99, 60, 361, 3723)] == [
        "0ms", "21ms", "1s", "1.6s", "60s", "1m0s", "6m1s", "1h2m3s"]


def test_window_headers_from_an_admission_answer():
    t = Tenant("acme", requests_per_minute=10, tokens_per_minute=1000)
    # admitted, no refusal, 0 wait, 4 requests and 300 tokens in the window, resets in 2.5 s / 2.5 s, 300 today
    w = window_of(t, [1, 0, 0, 4, 300, 2500, 2500, 300])
    assert w.headers() == {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "6",
                           "x-ratelimit-reset-requests": "2.5s", "x-ratelimit-limit-tokens": "1000",
                           "x-ratelimit-remaining-tokens": "700", "x-ratelimit-reset-tokens": "2.5s"}
    daily = window_of(Tenant("d", tokens_per_day=500), [1, 0, 0, 1, 20, 0, 0, 420])
    assert daily.headers()["x-ratelimit-remaining-tokens"] == "80" and daily.limit_requests is None
    assert Window().headers() == {}


def test_a_request_larger_than_a_token_limit_never_fits():
    t = Tenant("acme", tokens_per_minute=100)
    assert estimated_tokens(30, 70) == 100 and too_large_text(t, 100) is None
    assert "exceed its tokens_per_minute of 100" in too_large_text(t, 101)


def test_usage_table_shares_and_bounded_metric_labels():
    raw = {b"acme|generated_tokens": b"30", b"acme|requests": b"3", b"|generated_tokens": b"10", b"junk": b"1",
           b"x|prompt_tokens": b"nan"}
    total = usage_rows(raw)
    assert total["acme"]["generated_tokens"] == 30 and total[""]["generated_tokens"] == 10 and "junk" not in total
    rows = usage_table({"acme": Tenant("acme", 2, 60)}, total, {"acme": {"prompt_tokens": 5, "generated_tokens": 6}})
    assert [r["tenant"] for r in rows] == ["default", "acme"]  # a count that is no number: left out
    acme = rows[1]
    assert acme["share"] == 0.75 and acme["tokens_today"] == 11 and acme["requests_per_minute"] == 60
    text = render_usage(rows)
    assert text.splitlines()[0].split()[:3] == ["tenant", "requests", "prompt"] and "75.0%" in text
    assert [metric_label(x, ["acme"]) for x in ("", "acme", "zed")] == ["default", "acme", "other"]
    assert len(utc_day(0)) == 10 and utc_day(0) == "1970-01-01"


def test_tenant_gauges_fold_unknown_tenants_into_other():
    from batchfleet.gateway.tenant_metrics import tenant_families

    req, tok, lim = tenant_families({"acme": Tenant("acme", 2, 60)},
                                    {"acme": {"requests": 3, "generated_tokens": 30}, "": {"requests": 1},
                                     "zed": {"requests": 2}, "yak": {"requests": 5, "prompt_tokens": 7}})
    assert {s.labels["tenant"]: s.value for s in req.samples} == {"default": 1, "acme": 3, "other": 7}
    assert {(s.labels["tenant"], s.labels["kind"]) for s in tok.samples if s.value} == {("acme", "generated"),
                                                                                      ("other", "prompt")}
    assert {(s.labels["limit"], s.value) for s in lim.samples} == {("weight", 2.0), ("requests_per_minute", 60)}


def test_gateway_tenant_keys_are_api_keys_and_never_in_an_error():
    from batchfleet.gateway.config import GatewayConfig

    key = "sk-acme-0123456789abcdef"
    c = GatewayConfig(api_keys="plain-key-0123456", tenant_keys=f"acme:{key}")
    assert c.key_tenants == {key: "acme"} and set(c.api_keys) == {"plain-key-0123456", key}
    assert GatewayConfig(tenant_keys=f"acme:{key}:x").key_tenants == {f"{key}:x": "acme"}  # a key may hold a ':'
    # a bad entry's error shows none of it: the label's place may hold a key (swapped, or a key with a ':')
    for bad in (f"ACME:{key}", key.replace(":", ""), f"acme:{key},beta:{key}", "acme:short", f"{key}:acme",
                f":{key}", "Sk-acme-0123:456789abcdef"):
        with pytest.raises(ConfigError, match="tenant-key|key") as err:
            GatewayConfig(tenant_keys=bad)
        assert key not in str(err.value) and "sk-acme" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="both an --api-key .* and a --tenant-key"):  # which tenant: ambiguous
        GatewayConfig(api_keys=key, tenant_keys=f"acme:{key}")
    with pytest.raises(ConfigError, match="reserved.*a key of the default tenant is an --api-key"):
        GatewayConfig(tenant_keys=f"default:{key}")


def test_a_refusal_is_a_429_with_openais_headers():
    from batchfleet.gateway.errors import api_error

    window = window_of(Tenant("acme", requests_per_minute=2), [0, 1, 1500, 2, 0, 1500, 0, 0])
    err = api_error(RateLimited("rate limit reached", "requests_per_minute", 1.5, window))
    assert err.status == 429 and err.body()["error"]["code"] == "rate_limit_exceeded"
    assert err.type == "requests" and err.headers["Retry-After"] == "2"
    assert err.headers["x-ratelimit-remaining-requests"] == "0" and err.headers["x-ratelimit-reset-requests"] == "1.5s"


def test_a_call_names_its_tenant_checked_like_a_label():
    from batchfleet.common.errors import InvalidRequest
    from batchfleet.producer.ask import Ask

    assert Ask.of({"tenant": "acme", "max_new_tokens": 4}).tenant == "acme" and Ask.of({}).tenant == ""
    assert Ask.of({"tenant": None}).tenant == ""
    for bad in ("sk-Secret Key", 0, False, 7, ["acme"]):  # a falsy one too: never the default tenant silently
        with pytest.raises(InvalidRequest, match="tenant must be"):
            Ask.of({"tenant": bad})
