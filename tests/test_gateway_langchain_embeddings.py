"""Embeddings' token-id inputs and LangChain's ``OpenAIEmbeddings`` against a real gateway and worker (issue 58,
item 2): as written, it tokenizes with tiktoken and sends OpenAI's token ids, which is a 400 whose ``param`` is
``input`` and whose message names the vocabulary's size and the fix (``check_embedding_ctx_length=False``),
which then works; token ids inside the served model's vocabulary keep working, on the route and in batch lines.

tiktoken downloads its ``cl100k_base`` table at first use and the tests have no internet: a real tiktoken
``Encoding`` (byte-level, ids from 1000 up, where cl100k's ids lie: past the tiny model's vocabulary) is
registered under that name in tiktoken's own registry for the test, so LangChain's code runs unchanged."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import tiktoken
import tiktoken.registry
from langchain_openai import OpenAIEmbeddings
from tokenizers import Tokenizer

from tests.helpers.batches import bodies_of, run_batch

pytestmark = pytest.mark.integration
KEY = "sk-test-0123456789"
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog"]
TOLERANCE = 1e-4  # float32 vectors of the same inputs, maybe batched otherwise


@pytest.fixture
def cl100k_stand_in(monkeypatch) -> tiktoken.Encoding:
    ranks = {bytes([b]): 1000 + b for b in range(256)}
    encoding = tiktoken.Encoding("cl100k_base", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setitem(tiktoken.registry.ENCODINGS, "cl100k_base", encoding)
    return encoding


def test_langchain_openai_embeddings_as_written_gets_a_400_naming_input_and_the_fix(
        start_worker, start_gateway, cl100k_stand_in):
    start_worker(max_wait_ms=5)
    gw = start_gateway(api_keys=(KEY,))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    vocab = gw.run(gw.gateway.client.fleet(30)).info.vocab_size
    as_written = OpenAIEmbeddings(model=model, base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        as_written.embed_documents(TEXTS)
    err = info.value.body
    assert err["param"] == "input" and err["type"] == "invalid_request_error", err
    message = err["message"]
    assert message.startswith("input[0] holds token id 1") and f"vocabulary of {vocab} tokens" in message, message
    assert "check_embedding_ctx_length=False" in message and "OpenAIEmbeddings" in message
    with pytest.raises(openai.BadRequestError) as info:
        as_written.embed_query("a question")
    assert info.value.body["param"] == "input" and info.value.body["message"].startswith("input holds token id")

    fixed = OpenAIEmbeddings(model=model, base_url=gw.url + "/v1", api_key=KEY, max_retries=0,
                             check_embedding_ctx_length=False)
    vectors = fixed.embed_documents(TEXTS)
    direct = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert np.allclose(vectors, [d.embedding for d in direct.data], atol=TOLERANCE)
    assert np.allclose(fixed.embed_query(TEXTS[0]), direct.data[0].embedding, atol=TOLERANCE)


def test_token_ids_inside_the_vocabulary_keep_working(start_worker, start_gateway, tiny_model_dir, tmp_path):
    start_worker(max_wait_ms=5)
    gw = start_gateway(files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    vocab = gw.run(gw.gateway.client.fleet(30)).info.vocab_size
    ids = [Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(t).ids for t in TEXTS]
    by_text = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    one = client.embeddings.create(model=model, input=ids[0], encoding_format="float")
    assert np.allclose([d.embedding for d in by_ids.data], [d.embedding for d in by_text.data], atol=TOLERANCE)
    assert np.allclose(one.data[0].embedding, by_text.data[0].embedding, atol=TOLERANCE)
    edge = client.embeddings.create(model=model, input=[0, vocab - 1])  # both ends of the vocabulary
    assert len(edge.data) == 1 and edge.usage.prompt_tokens == 2
    with httpx.Client(base_url=gw.url + "/v1", timeout=60) as http:
        for body, where in (({"input": [ids[0], [5, vocab]]}, "input[1]"), ({"input": [vocab + 7]}, "input"),
                            ({"input": [[-1]]}, "input")):
            resp = http.post("/embeddings", json=body)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "input" and err["message"].startswith(f"{where} holds token id"), err
            assert f"vocabulary of {vocab} tokens" in err["message"]
    batch = run_batch(client, "/v1/embeddings", {"ok": {"input": ids, "encoding_format": "float"},
                                                 "tiktoken": {"input": [[1000 + b for b in b"Hello"]]}})
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    (error,) = bodies_of(client, batch.error_file_id).items()
    assert error[0] == "tiktoken" and error[1]["error"]["param"] == "input", error
    out = bodies_of(client, batch.output_file_id)["ok"]["data"]
    assert np.allclose([d["embedding"] for d in out], [d.embedding for d in by_text.data], atol=TOLERANCE)
