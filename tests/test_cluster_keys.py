"""Redis Cluster URLs and hash-tagged key names (pure: no Redis). The fleet on a real cluster:
tests/test_cluster.py."""

from __future__ import annotations

import pytest

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import fleet_slot
from batchfleet.common.redis.url import parse_cluster_url


@pytest.mark.unit
def test_cluster_url_parsing_and_hash_tagged_keys():
    c = parse_cluster_url("redis+cluster://u:p%40ss@h1:7001,h2")
    assert c.nodes == (("h1", 7001), ("h2", 6379)) and (c.username, c.password) == ("u", "p@ss")
    conn = ConnectionConfig("redis+cluster://h1:7001/0", "ns")
    assert conn.keys.stream(128) == "{ns}:stream:128" and conn.keys.inbox("x" * 16) == "{ns}:inbox:" + "x" * 16
    assert conn.keys.inbox_token("{ns}:inbox:" + "x" * 16) == "x" * 16 and conn.keys.inbox_token("ns:inbox:x") is None
    assert ConnectionConfig("redis://h:1/0", "ns").keys.stream(128) == "ns:stream:128"  # one Redis: unchanged
    for bad in ("redis+cluster://", "redis+cluster://h:x", "redis+cluster://:secret@h:1/3",
                "redis+cluster://:secret@h:99999", "redis+cluster://h:0", "redis+sentinel://h:70000/m",
                # bytes that were no UTF-8 (argv / environment: lone surrogates) and control characters, any form
                "redis+cluster://:secret@h\udcff:1", "redis://:secret@h\udcff:1/0", "redis://:secret@h\n:1/0",
                "redis+sentinel://:secret@s\udcff/m/0"):
        with pytest.raises(ConfigError) as err:
            ConnectionConfig(bad)
        assert "secret" not in str(err.value)


@pytest.mark.unit
def test_keys_of_one_redis_keep_their_names():
    """A single Redis (the default) keeps the key names it always had: upgrading moves nothing."""
    assert Keys("bf").stream(128) == "bf:stream:128" and Keys("bf").pattern == "bf:*"
    assert Keys("bf", hashtag=True).pattern == "{bf}:*"
    with pytest.raises(ValueError):  # braces are not namespace characters: a tag cannot be split
        Keys("b{f}", hashtag=True)


@pytest.mark.unit
def test_the_slot_of_fcall_and_xreadgroup_is_their_first_key():
    """redis-py would ask the server (COMMAND GETKEYS) for these: the fleet's keys share one tag."""
    from redis.crc import key_slot

    slot = key_slot(b"{bf}:stream:32")
    assert fleet_slot(("FCALL", "batchfleet_enqueue", 2, "{bf}:stream:32", "{bf}:workers", "x")) == slot
    assert fleet_slot(("XREADGROUP", "GROUP", "workers", "w1", "COUNT", 8, "BLOCK", 100, "STREAMS",
                       "{bf}:stream:32", "{bf}:stream:64", ">", ">")) == slot
    assert fleet_slot(("XADD", "{bf}:stream:32", "*", "a", "b")) is None  # redis-py knows where its key is
    assert fleet_slot(("FCALL", "f", 0)) is None
