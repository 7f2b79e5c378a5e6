"""Token counting with o200k_base, offline, cached per message.

The rank file ships in the package (`gateway/data/o200k_base.tiktoken`) and is loaded
through tiktoken with the sha256 tiktoken itself expects, so a corrupted or swapped
file is refused instead of silently miscounting. Nothing here touches the network.

How tokens are counted (OpenAI-like; the scripted provider, budgets and the demo's
figures all use exactly this):

Prompt tokens of a request (`count_request`):
  for every message:   3 (per-message overhead)
                     + tokens(role)
                     + tokens(content)          text, or the text parts of a list; None = 0
                     + tokens(name) + 1         only if the message has a `name`
                     + tokens(tool_call_id)     only on tool messages
                     + tokens(tool calls JSON)  only if the message has `tool_calls`
  + tokens(tools JSON)                          the `tools` array as compact JSON, if any
  + 3                                           reply priming (`<|start|>assistant<|message|>`)

Completion tokens of a reply (`count_completion`):
  tokens(content) + tokens(tool calls JSON), where the tool calls JSON of a reply
  without tool calls is `[]` (one token, standing for the end of the message).

"Tool calls JSON" is always the canonical compact form
`[{"id":..,"type":"function","function":{"name":..,"arguments":..}}]`, built from each
call's id, function name and arguments string, so the same call counts the same whether
it arrives from a client, an upstream or a stream reassembled from deltas.

A transcript is re-sent on every turn, so counting is cached twice over, both bounded by a
number of messages and by the characters they hold (`cache_chars`: tool results of a few KB
would otherwise keep tens of MB alive in a long-running gateway):
- `count_message` keeps an LRU keyed by a tuple of the message's strings (whose hashes
  Python caches): counting a 100-turn run encodes each message once, not once per turn;
- `count_messages` remembers the last transcript seen per first message with its running
  totals, and checks the shared prefix with one C-level list comparison, so a turn costs
  the new messages plus a cheap comparison rather than a Python walk of the transcript.
Both compare message *contents*, so a transcript edited in the middle is recounted from
the first difference, and a message edited in place after counting is not mistaken for
the old one (the remembered transcript holds copies).
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import tiktoken

ENCODING_NAME = "o200k_base"
ENCODING_PATH = Path(__file__).resolve().parent / "data" / "o200k_base.tiktoken"
ENCODING_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

# Copied from tiktoken_ext.openai_public.o200k_base (tiktoken 0.14), which would
# otherwise fetch the rank file from the internet.
O200K_PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
O200K_SPECIAL_TOKENS: Mapping[str, int] = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
DEFAULT_CACHE_SIZE = 16_384
DEFAULT_CACHE_CHARS = 4_000_000

# (role, content, name, tool_call_id, ((id, name, arguments), ...))
MessageKey = tuple[str, Any, str | None, str | None, tuple[tuple[str, str, str], ...]]


class EncodingFileError(ValueError):
    """The rank file is missing or does not have the expected sha256."""


def load_encoding(path: Path = ENCODING_PATH, expected_hash: str = ENCODING_SHA256) -> tiktoken.Encoding:
    """Build o200k_base from a local rank file, refusing it unless its sha256 matches."""
    # A resolved local path never contains "://", so tiktoken reads the file and never downloads.
    location = str(Path(path).resolve())
    if not Path(location).is_file():
        raise EncodingFileError(f"{location}: o200k_base rank file not found")
    data = Path(location).read_bytes()
    if hashlib.sha256(data).hexdigest() != expected_hash:
        raise EncodingFileError(f"{location}: not the official o200k_base rank file (sha256 must be {expected_hash})")
    return LeanEncoding(location, expected_hash, _ranks(data))


def _ranks(data: bytes) -> dict[bytes, int]:
    """The rank table of a hash-checked file: what tiktoken's `load_tiktoken_bpe` reads, in
    half its time (one C call per line instead of `base64.b64decode`'s Python wrapper): every
    gateway process and CLI call pays this at start."""
    a2b = binascii.a2b_base64
    return {a2b(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}


class LeanEncoding(tiktoken.Encoding):
    """o200k_base without tiktoken's Python copy of the rank table (~28 MB of the gateway's RSS).

    tiktoken's Rust core keeps its own copy, which is all that encoding and decoding use;
    the Python dict only serves pickling, which here reloads the (hash-checked) file instead.
    """

    def __init__(self, location: str, expected_hash: str, ranks: dict[bytes, int]) -> None:
        super().__init__(name=ENCODING_NAME, pat_str=O200K_PAT_STR, mergeable_ranks=ranks,
                         special_tokens=dict(O200K_SPECIAL_TOKENS))
        self._source = (Path(location), expected_hash)
        del self._mergeable_ranks

    def __reduce__(self) -> tuple[Any, tuple[Path, str]]:
        return load_encoding, self._source


def _text(content: Any) -> Any:
    """The countable part of a content field, in a hashable form."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return tuple(
            str(part.get("text") or "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return str(content)


def _calls(tool_calls: Any) -> tuple[tuple[str, str, str], ...]:
    """(id, name, arguments) of each call; what is not shaped like a call counts as empty
    strings, since counting must never fail on a message it is handed (a stored run, an
    upstream's reply)."""
    if not tool_calls or not isinstance(tool_calls, (list, tuple)):
        return ()
    out = []
    for call in tool_calls:
        if not isinstance(call, Mapping):
            out.append(("", "", ""))
            continue
        function = call.get("function")
        if not isinstance(function, Mapping):
            function = {}
        out.append((str(call.get("id") or ""), str(function.get("name") or ""), str(function.get("arguments") or "")))
    return tuple(out)


def _frozen(msg: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a message that later in-place edits of the caller's dicts cannot change.

    Strings are shared, not copied, so comparing against the caller's messages stays cheap.
    """
    out = dict(msg)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [
            {**c, "function": dict(c["function"])} if isinstance(c, dict) and isinstance(c.get("function"), dict)
            else c
            for c in calls
        ]
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [dict(p) if isinstance(p, dict) else p for p in content]
    return out


def _key_chars(key: MessageKey) -> int:
    """Characters a cached message key keeps alive."""
    role, content, name, call_id, calls = key
    n = len(role) + len(name or "") + len(call_id or "") + sum(len(a) + len(b) + len(c) for a, b, c in calls)
    if isinstance(content, str):
        return n + len(content)
    if isinstance(content, tuple):
        return n + sum(len(part) for part in content)
    return n


def _message_chars(msg: Mapping[str, Any]) -> int:
    """Characters of a message's content and tool-call arguments (what a remembered transcript holds)."""
    content = msg.get("content")
    n = len(content) if isinstance(content, str) else 0
    if isinstance(content, list):
        n += sum(len(str(part.get("text") or "")) for part in content if isinstance(part, Mapping))
    calls = msg.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            n += len(str(function.get("arguments") or ""))
    return n


def _common_prefix(a: list[Mapping[str, Any]], b: list[Mapping[str, Any]]) -> int:
    """How many leading messages `a` and `b` have in common."""
    k = min(len(a), len(b))
    if (a[:k] == b) if k == len(b) else (a == b[:k]):  # usual: last turn's transcript + new messages
        return k
    for i in range(k):
        if a[i] != b[i]:
            return i
    return k


def tool_calls_json(calls: Sequence[tuple[str, str, str]]) -> str:
    """The canonical compact JSON of tool calls given as (id, name, arguments)."""
    return orjson.dumps(
        [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]
    ).decode()


class TokenCounter:
    """Counts prompts and completions the way the module docstring describes."""

    def __init__(self, encoding: tiktoken.Encoding, cache_size: int = DEFAULT_CACHE_SIZE,
                 cache_chars: int = DEFAULT_CACHE_CHARS) -> None:
        self.encoding = encoding
        self.cache_size = cache_size
        self.cache_chars = cache_chars
        self._messages: OrderedDict[MessageKey, int] = OrderedDict()
        self._message_chars = 0
        self._tools: OrderedDict[bytes, int] = OrderedDict()
        # first message (role, content) -> (copies of the last transcript, running totals,
        # and the messages and characters `_held` / `_held_chars` counted for it)
        self._transcripts: OrderedDict[Any, tuple[list[Mapping[str, Any]], list[int], int, int]] = OrderedDict()
        self._held = 0
        self._held_chars = 0
        self._lock = threading.Lock()
        self._empty_calls = self.count_text("[]")

    def count_text(self, text: str) -> int:
        """Tokens of plain text; special-token strings count as ordinary text."""
        return len(self.encoding.encode_ordinary(text)) if text else 0

    def _content(self, content: Any) -> int:
        if content is None:
            return 0
        if isinstance(content, str):
            return self.count_text(content)
        return sum(self.count_text(part) for part in content)

    def count_message(self, msg: Mapping[str, Any]) -> int:
        """Prompt tokens one message contributes (cached by its strings)."""
        key: MessageKey = (
            str(msg.get("role") or ""),
            _text(msg.get("content")),
            None if (name := msg.get("name")) is None else str(name),
            None if (call_id := msg.get("tool_call_id")) is None else str(call_id),
            _calls(msg.get("tool_calls")),
        )
        with self._lock:
            hit = self._messages.get(key)
            if hit is not None:
                self._messages.move_to_end(key)
                return hit
        role, content, name, call_id, calls = key
        n = TOKENS_PER_MESSAGE + self.count_text(role) + self._content(content)
        if name is not None:
            n += self.count_text(name) + TOKENS_PER_NAME
        if call_id is not None:
            n += self.count_text(call_id)
        if calls:
            n += self.count_text(tool_calls_json(calls))
        with self._lock:
            if key not in self._messages:
                self._message_chars += _key_chars(key)
            self._messages[key] = n
            while self._messages and (len(self._messages) > self.cache_size or self._message_chars > self.cache_chars):
                old, _ = self._messages.popitem(last=False)
                self._message_chars -= _key_chars(old)
        return n

    def count_messages(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Prompt tokens of the messages alone (no tools, no reply priming).

        The longest prefix shared with the last transcript that began with the same message
        is not walked again in Python: one C-level list comparison checks it, and its
        running total is reused; only the new tail goes through `count_message`.
        """
        msgs = messages if isinstance(messages, list) else list(messages)  # only read, never kept
        if not msgs or self.cache_size <= 0:
            return sum(self.count_message(m) for m in msgs)
        first = msgs[0]
        anchor = (str(first.get("role")), _text(first.get("content")))
        with self._lock:
            memo = self._transcripts.get(anchor)
            if memo is not None:
                self._transcripts.move_to_end(anchor)
        snapshot: list[Mapping[str, Any]] = []
        totals: list[int] = []
        chars = 0
        if memo is not None:
            shared = _common_prefix(msgs, memo[0])
            if shared == len(msgs):
                return memo[1][shared - 1]
            # Extending the remembered transcript (the usual turn) reuses its lists.
            if shared == len(memo[0]):
                snapshot, totals, chars = memo[0], memo[1], memo[3]
            else:
                snapshot, totals = memo[0][:shared], memo[1][:shared]
                chars = sum(_message_chars(m) for m in snapshot)
        total = totals[-1] if totals else 0
        for m in msgs[len(totals):]:
            total += self.count_message(m)
            totals.append(total)
            snapshot.append(_frozen(m))
            chars += _message_chars(m)
        with self._lock:
            old = self._transcripts.pop(anchor, None)
            self._held += len(snapshot) - (old[2] if old else 0)
            self._held_chars += chars - (old[3] if old else 0)
            self._transcripts[anchor] = (snapshot, totals, len(snapshot), chars)
            while (self._held > self.cache_size or self._held_chars > self.cache_chars) and len(self._transcripts) > 1:
                _, (_, _, held, held_chars) = self._transcripts.popitem(last=False)
                self._held -= held
                self._held_chars -= held_chars
        return total

    def count_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> int:
        """Tokens of the `tools` array as compact JSON (0 when there are none)."""
        if not tools:
            return 0
        blob = orjson.dumps(tools if isinstance(tools, list) else list(tools))
        with self._lock:
            hit = self._tools.get(blob)
            if hit is not None:
                self._tools.move_to_end(blob)
                return hit
        n = self.count_text(blob.decode())
        with self._lock:
            self._tools[blob] = n
            if len(self._tools) > 256:
                self._tools.popitem(last=False)
        return n

    def count_request(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Prompt tokens of a chat-completions request."""
        return self.count_messages(messages) + self.count_tools(tools) + REPLY_PRIMING

    def count_completion(self, message: Mapping[str, Any]) -> int:
        """Completion tokens of an assistant reply: content plus its tool calls JSON."""
        n = self._content(_text(message.get("content")))
        calls = _calls(message.get("tool_calls"))
        return n + (self.count_text(tool_calls_json(calls)) if calls else self._empty_calls)

    def cache_info(self) -> dict[str, int]:
        """Entries held by the caches (messages, tools, remembered transcripts and their messages)
        and the characters they keep alive."""
        return {"messages": len(self._messages), "tools": len(self._tools), "transcripts": len(self._transcripts),
                "transcript_messages": self._held, "max_messages": self.cache_size,
                "message_chars": self._message_chars, "transcript_chars": self._held_chars,
                "max_chars": self.cache_chars}


@functools.cache
def get_counter() -> TokenCounter:
    """The process-wide counter over the packaged o200k_base (loaded once)."""
    return TokenCounter(load_encoding())
