"""o200k_base offline: same counts as tiktoken's own encoding, hash-checked, linear caching."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken_ext.openai_public as openai_public

from gateway.tokens import (
    ENCODING_PATH,
    ENCODING_SHA256,
    REPLY_PRIMING,
    TOKENS_PER_MESSAGE,
    EncodingFileError,
    TokenCounter,
    get_counter,
    load_encoding,
)

SAMPLES = [
    "",
    "hello world",
    "Which file mentions a timeout?",
    "errors.log mentions a timeout: worker 7 timed out after 30000 ms.",
    "Ünïcödé, 日本語のテキスト, emoji 🤖 and tabs\tand\nnewlines",
    '{"path":"../../etc/passwd"}',
    "<|endoftext|> is only text here",
    "x" * 5000,
]


@pytest.fixture(scope="module")
def reference() -> tiktoken.Encoding:
    """tiktoken's own o200k_base, its rank file read from our copy instead of the internet."""
    real_loader = openai_public.load_tiktoken_bpe

    def local(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        assert url.endswith("/o200k_base.tiktoken") and expected_hash == ENCODING_SHA256
        return real_loader(str(ENCODING_PATH), expected_hash=expected_hash)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openai_public, "load_tiktoken_bpe", local)
        spec = openai_public.o200k_base()
    return tiktoken.Encoding(**spec)


@pytest.mark.parametrize("text", SAMPLES)
def test_count_text_matches_tiktoken_o200k_base(reference: tiktoken.Encoding, text: str) -> None:
    counter = get_counter()
    assert counter.count_text(text) == len(reference.encode(text, disallowed_special=()))
    assert counter.encoding.encode_ordinary(text) == reference.encode_ordinary(text)


def test_encoding_is_o200k_base(reference: tiktoken.Encoding) -> None:
    enc = get_counter().encoding
    assert enc.name == "o200k_base"
    assert enc.n_vocab == reference.n_vocab
    assert enc._pat_str == reference._pat_str
    assert enc._special_tokens == reference._special_tokens


def test_tampered_rank_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken would keep a copy of each new path in /tmp
    data = bytearray(ENCODING_PATH.read_bytes())
    data[100] = ord("A") if data[100] != ord("A") else ord("B")
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(bytes(data))
    with pytest.raises(EncodingFileError, match="sha256"):
        load_encoding(bad)
    good = tmp_path / "copy.tiktoken"
    good.write_bytes(ENCODING_PATH.read_bytes())
    assert load_encoding(good).encode_ordinary("hello") == get_counter().encoding.encode_ordinary("hello")


def test_missing_rank_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EncodingFileError, match="not found"):
        load_encoding(tmp_path / "nope.tiktoken")


def test_message_and_request_arithmetic() -> None:
    c = get_counter()
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a"}'}}
    calls_json = json.dumps([call], separators=(",", ":"))
    system = {"role": "system", "content": "Be brief."}
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "text of a"}
    t = c.count_text
    assert c.count_message(system) == TOKENS_PER_MESSAGE + t("system") + t("Be brief.")
    assert c.count_message(assistant) == TOKENS_PER_MESSAGE + t("assistant") + t(calls_json)
    assert c.count_message(tool) == TOKENS_PER_MESSAGE + t("tool") + t("text of a") + t("c1") + t("read_file") + 1
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    messages = [system, assistant, tool]
    expected = sum(c.count_message(m) for m in messages) + t(json.dumps(tools, separators=(",", ":"))) + REPLY_PRIMING
    assert c.count_request(messages, tools) == expected
    assert c.count_request(messages) == expected - c.count_tools(tools)
    # list-of-parts content counts its text parts
    parts = {"role": "user", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}
    assert c.count_message(parts) == TOKENS_PER_MESSAGE + t("user") + t("Be ") + t("brief.")


def test_completion_counts_content_and_tool_calls_json() -> None:
    c = get_counter()
    # The chapter's three plan replies: 23, 29 and 18 completion tokens.
    list_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]}
    read_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"errors.log"}'}}]}
    answer = {"role": "assistant", "content": "errors.log mentions a timeout: worker 7 timed out after 30000 ms."}
    assert [c.count_completion(m) for m in (list_call, read_call, answer)] == [23, 29, 18]
    assert c.count_completion(answer) == c.count_text(answer["content"]) + c.count_text("[]")


class CountingEncoding:
    """Wraps an encoding and counts the encode calls made through it."""

    def __init__(self, inner: tiktoken.Encoding) -> None:
        self.inner = inner
        self.calls = 0

    def encode_ordinary(self, text: str) -> list[int]:
        self.calls += 1
        return self.inner.encode_ordinary(text)


def _runaway(turns: int) -> list[list[dict[str, Any]]]:
    """The request transcripts of a runaway run, one per turn (each a fresh copy, as over HTTP)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    requests = []
    for turn in range(turns):
        requests.append(json.loads(json.dumps(messages)))
        cid = f"c{turn + 1}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "name": "list_files", "content": f"listing {turn}"})
    return requests


def test_counting_a_growing_transcript_is_linear() -> None:
    spy = CountingEncoding(get_counter().encoding)
    counter = TokenCounter(spy)  # type: ignore[arg-type]
    spy.calls = 0
    requests = _runaway(100)
    totals = [counter.count_request(r) for r in requests]
    # Every message is encoded once (role, content, id, name, calls), not once per turn.
    final = requests[-1]
    fresh_spy = CountingEncoding(get_counter().encoding)
    fresh = TokenCounter(fresh_spy)  # type: ignore[arg-type]
    fresh_spy.calls = 0
    assert fresh.count_request(final) == totals[-1]
    once = fresh_spy.calls
    assert spy.calls == once, (spy.calls, once)
    assert all(b > a for a, b in zip(totals, totals[1:]))
    # Without a cache the same 100 turns would encode ~50x as much.
    uncached_spy = CountingEncoding(get_counter().encoding)
    uncached = TokenCounter(uncached_spy, cache_size=0)  # type: ignore[arg-type]
    uncached_spy.calls = 0
    assert [uncached.count_request(r) for r in requests] == totals
    assert uncached_spy.calls > 40 * once


def test_cache_is_bounded() -> None:
    counter = TokenCounter(get_counter().encoding, cache_size=8)
    for i in range(50):
        counter.count_message({"role": "user", "content": f"message {i}"})
    assert counter.cache_info()["messages"] == 8


def test_prefix_memo_recounts_edited_transcripts() -> None:
    requests = _runaway(6)
    final = requests[-1]
    expected = get_counter().count_messages(json.loads(json.dumps(final)))
    counter = TokenCounter(get_counter().encoding)
    assert counter.count_messages(final) == expected
    # Edited in the middle (a fresh copy): recounted from the first difference.
    edited = json.loads(json.dumps(final))
    edited[5]["content"] = "a much longer listing than before, with many more words in it"
    fresh = TokenCounter(get_counter().encoding)
    assert counter.count_messages(edited) == fresh.count_messages(edited) != expected
    # Edited in place after being counted: the remembered copy is not fooled.
    counter.count_messages(final)
    final[3]["content"] = "changed in place " * 10
    assert counter.count_messages(final) == TokenCounter(get_counter().encoding).count_messages(final)
    # A shorter prefix of a remembered transcript, and an unrelated one.
    assert counter.count_messages(final[:4]) == fresh.count_messages(final[:4])
    other = [{"role": "system", "content": "other"}, {"role": "user", "content": "x"}]
    assert counter.count_messages(other) == fresh.count_messages(other)


def test_remembered_transcripts_are_bounded() -> None:
    counter = TokenCounter(get_counter().encoding, cache_size=8)
    for i in range(50):
        counter.count_messages([{"role": "system", "content": f"run {i}"}, {"role": "user", "content": "go"}])
    info = counter.cache_info()
    assert info["transcript_messages"] <= 8 and info["transcripts"] <= 4


def test_the_encoding_keeps_no_python_rank_table_and_still_round_trips() -> None:
    enc = get_counter().encoding
    assert not hasattr(enc, "_mergeable_ranks")  # the Rust core's copy is the only one kept
    text = "Ünïcödé, 日本語 and a timeout after 30000 ms"
    tokens = enc.encode_ordinary(text)
    assert enc.decode(tokens) == text
    assert enc.decode_single_token_bytes(tokens[0]) == enc.decode_bytes(tokens[:1])
    assert enc.encode("<|endoftext|>", allowed_special="all") == [199999]
    again = pickle.loads(pickle.dumps(enc))  # pickled by reference to the hash-checked file
    assert again is not enc and again.encode_ordinary(text) == tokens


def test_caches_are_bounded_by_the_characters_they_hold() -> None:
    counter = TokenCounter(get_counter().encoding, cache_chars=50_000)
    reference = TokenCounter(get_counter().encoding, cache_size=0)
    for run in range(6):  # agent runs whose tool results are a few KB each
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"run {run}"}]
        for turn in range(8):
            messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": f"{run}-{turn} " + "x" * 3000})
            assert counter.count_request(messages) == reference.count_request(messages)
    info = counter.cache_info()
    assert info["message_chars"] <= 50_000 and info["transcript_chars"] <= 50_000
    assert info["messages"] < 6 * 8  # older messages were let go to stay within the budget
