"""Identical prefixes stay identical: the producer's tokenizing (text and chat messages, through the fleet's
chat template) gives every request with the same system prompt the same leading tokens, whatever follows,
so the workers' prefix cache can share them. Nothing per request (ids, dates, randomness) comes first."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.producer.core import FleetView

pytestmark = pytest.mark.integration  # the byte-level tokenizer: transformers (not a unit test's import)

SYSTEM = ("You are a careful assistant for an online bookshop. Answer questions about orders, shipping and "
          "returns in two sentences at most. Never invent an order number; ask for it instead.")
USERS = ["Where is my order?", " leading space", "\nnewline first", "Ça marche ? ünïcödé ✓", "!!!", "a" * 300,
         "Order 12345 has not arrived yet, can you check?"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE with merges across the system prompt's words, ChatML specials, BOS prepended:
    the kind of tokenizer whose merges could in principle reach across the prompt boundary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([SYSTEM] * 20 + USERS * 5, trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return tok


def byte_tokenizer() -> Tokenizer:
    """The built-in presets' tokenizer (one token per byte, BOS prepended)."""
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer().backend_tokenizer


def view(tok: Tokenizer, template: str) -> FleetView:
    v = FleetView()
    v.update(FleetInfo(model="m", tokenizer_json=tok.to_str(), buckets=(4096,), max_seq_len=4096, max_batch_size=8,
                       vocab_size=tok.get_vocab_size(), eos_token_ids=(1,), chat_template=template,
                       bos_token="<s>", eos_token="</s>").encode())
    return v


def common_prefix(seqs: list[list[int]]) -> int:
    n = 0
    while all(len(s) > n and s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_same_system_prompt_gives_the_same_leading_tokens(kind):
    from batchfleet.worker.engine.tokenizer import PRESET_CHAT_TEMPLATE

    tok, template = (byte_tokenizer(), PRESET_CHAT_TEMPLATE) if kind == "byte" else (bpe_tokenizer(), CHATML)
    v = view(tok, template)
    chats = [v.tokenize([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]) for u in USERS]
    # the whole system turn, as the template writes it before the first user turn
    turn = "<|system|>\n" + SYSTEM + "\n" if kind == "byte" else "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n"
    head = tok.encode(turn).ids
    assert len(head) > 20 and all(c[:len(head)] == head for c in chats)
    assert chats == [v.tokenize([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}])
                     for u in USERS]  # deterministic: nothing per request
    # text prompts: the system prompt's tokens, but for the last one when a merge reaches across
    texts = [v.tokenize(SYSTEM + " " + u) for u in USERS]
    assert common_prefix(texts) >= len(tok.encode(SYSTEM).ids) - 1
