"""The repair of a streamed reply (`stream_repair`), on replies recorded from the real local model.

Each recorded reply is streamed as the scripted provider streams any reply (its own
`stream_chunks`), fed to the real `Reassembly`, and written through the real `ChatOutlet`:
what the client would read is parsed back and compared with what the non-streamed repair
makes of the same reply.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from gateway.config.settings import UpstreamConfig
from gateway.providers.repair import repair_completion, tool_schemas
from gateway.providers.scripted import Ask, stream_chunks
from gateway.providers.upstream import Upstream
from gateway.server.chat.stream_events import ChatOutlet, Reassembly
from gateway.server.chat.stream_repair import StreamRepair
from gateway.tools.catalog import FILE_TOOLS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "local_replies"
TOOLS = [t.openai() for t in FILE_TOOLS]
USAGE = {"prompt_tokens": 300, "completion_tokens": 20, "total_tokens": 320}


def recorded(name: str) -> dict[str, Any]:
    reply: dict[str, Any] = orjson.loads((FIXTURES / name).read_bytes())["reply"]
    return reply


def upstream(tool_repair: bool = True) -> Upstream:
    return Upstream(UpstreamConfig("small", kind="local", base_url="http://127.0.0.1:9/v1", tool_repair=tool_repair),
                    SimpleNamespace(request=None), lambda: None)  # type: ignore[arg-type]  # never sends: only its config is read


def events_of(message: dict[str, Any], finish: str) -> list[bytes]:
    ask = Ask("m", [{"role": "user", "content": "x"}], TOOLS, True, True, None)
    return [b"data: " + orjson.dumps(c) + b"\n\n" for c in stream_chunks(ask, message, finish, USAGE)]


def stream(message: dict[str, Any], finish: str, tool_repair: bool = True,
           events: list[bytes] | None = None) -> tuple[list[bytes], Reassembly, StreamRepair | None]:
    """What the client is sent as the events come, then at the end; and the reassembly booked."""
    got, out = Reassembly(), ChatOutlet(include_usage=True)
    repair = StreamRepair.of(upstream(tool_repair), TOOLS, 1)
    sent: list[bytes] = []
    failed = False
    for event in events or events_of(message, finish):  # as stream_through reads them
        kind = got.feed(event)
        if kind == "done":
            break
        sent.append(repair.pass_on(kind, event, got, out) if repair is not None else out.event(kind, event, got.last))
        if kind == "error" and (repair is None or repair.parse_error is None):
            failed = True
            break
    if repair is not None:
        if not failed:
            repair.repair(got)
        sent.append(repair.tail(out))
    return sent, got, repair


def client_view(sent: list[bytes]) -> tuple[str | None, list[tuple[str, dict[str, Any]]], str | None]:
    """(content, tool calls, finish reason) as an OpenAI client assembles them from the events."""
    rebuilt = Reassembly()
    for blob in sent:
        for event in blob.split(b"\n\n"):
            if event.strip():
                rebuilt.feed(event + b"\n\n")
    message = rebuilt.message()
    calls = [(c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return message["content"] or None, calls, rebuilt.finish  # a role chunk's "" is no text


def test_a_call_written_as_json_in_the_content_reaches_the_client_as_a_tool_call() -> None:
    reply = recorded("call_in_content.json")["choices"][0]
    sent, got, repair = stream(reply["message"], reply["finish_reason"])
    assert client_view(sent) == (None, [("read_file", {"path": "notes.txt"})], "tool_calls")
    assert repair is not None and [(r.kind, r.tool) for r in repair.repairs] == [("call_from_text", "read_file")]
    booked = got.message()
    assert booked["content"] is None and got.finish == "tool_calls"
    assert booked["tool_calls"][0]["function"]["name"] == "read_file"
    assert b"notes.txt" not in b"".join(sent[:1])  # the JSON text itself never reached the client


def test_the_stream_repairs_what_the_plain_reply_repair_does() -> None:
    for name in ("call_in_content.json", "fenced_call.json", "schema_as_arguments.json",
                 "schema_required_in_arguments.json", "retry_two_calls_in_content.json"):
        data = recorded(name)
        reply = data["choices"][0]
        sent, got, repair = stream(reply["message"], reply["finish_reason"])
        plain = repair_completion(data, tool_schemas(TOOLS))
        want = plain.data["choices"][0]
        calls = [(c["function"]["name"], orjson.loads(c["function"]["arguments"]))
                 for c in want["message"].get("tool_calls") or []]
        content, got_calls, finish = client_view(sent)
        assert (got_calls, finish) == (calls, want["finish_reason"]), name
        assert repair is not None and [r.kind for r in repair.repairs] == [r.kind for r in plain.repairs], name
        assert [(c["function"]["name"], orjson.loads(c["function"]["arguments"]))
                for c in got.message().get("tool_calls", [])] == calls, name


def test_arguments_with_the_schema_in_them_are_repaired_before_the_client_sees_them() -> None:
    reply = recorded("schema_required_in_arguments.json")["choices"][0]
    sent, _, _ = stream(reply["message"], reply["finish_reason"])
    assert client_view(sent)[1] == [("read_file", {"path": "C:\\path\\to\\log.txt"})]
    assert b"required" not in b"".join(sent)


def test_a_plain_answer_streams_as_it_comes_and_unchanged() -> None:
    message = {"role": "assistant", "content": "notes.txt is the team's runbook for the on-call week."}
    events = events_of(message, "stop")
    sent, got, repair = stream(message, "stop", events=events)
    plain_sent, _, _ = stream(message, "stop", tool_repair=False, events=events)
    assert b"".join(sent) == b"".join(plain_sent)  # nothing held, nothing added
    assert repair is not None and repair.repairs == ()
    assert got.message()["content"] == message["content"]


def test_text_that_could_be_a_call_but_is_not_arrives_whole_and_byte_exact() -> None:
    message = {"role": "assistant", "content": "The config says {retries: 3}; see `app.yaml` for <more>."}
    events = events_of(message, "stop")
    sent, got, repair = stream(message, "stop", events=events)
    plain_sent, _, _ = stream(message, "stop", tool_repair=False, events=events)
    assert b"".join(sent) == b"".join(plain_sent)
    assert repair is not None and repair.repairs == () and b"retries" in sent[-1]  # held, then sent at the end
    assert client_view(sent) == (message["content"], [], "stop")


def test_prose_sent_before_a_fenced_call_stays_the_text_of_the_booked_message() -> None:
    message = {"role": "assistant",
               "content": "The question is about notes.txt, so I will read that file first and then answer you. "
                          "```json\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"notes.txt\"}}\n```"}
    sent, got, _ = stream(message, "stop")
    content, calls, finish = client_view(sent)
    assert calls == [("read_file", {"path": "notes.txt"})] and finish == "tool_calls"
    assert content is not None and "```" not in content and got.message()["content"] == content


def test_no_repair_without_tool_repair_or_without_tools() -> None:
    assert StreamRepair.of(upstream(tool_repair=False), TOOLS, 1) is None
    assert StreamRepair.of(upstream(), None, 1) is None
    assert StreamRepair.of(upstream(), TOOLS, 2) is None  # several choices: only choice 0 could be repaired


def test_a_stream_llamacpp_ends_with_its_parse_error_becomes_the_repaired_reply() -> None:
    # Recorded from `gateway local --model gemma3-270m` (llama.cpp streams the text, then the error event).
    events = [e + b"\n\n" for e in (FIXTURES / "gemma_stream_parse_error.sse").read_bytes().split(b"\n\n") if e.strip()]
    assert b"peg-native format" in events[-1]
    text = "".join(orjson.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    sent, got, repair = stream({}, "stop", events=events)
    plain_sent, _, _ = stream({}, "stop", tool_repair=False, events=events)
    assert b"peg-native format" in b"".join(plain_sent)  # without repair the 500 reaches the client
    assert b"error" not in b"".join(sent)
    assert repair is not None and [r.kind for r in repair.repairs][:1] == ["parse_error_dropped"]
    content, calls, finish = client_view(sent)
    assert (content, calls, finish) == (text, [], "stop")  # no call in it: the text is the answer, whole
    assert got.message()["content"] == text and got.finish == "stop"


def test_another_error_ends_the_stream_after_what_was_held() -> None:
    message = {"role": "assistant", "content": "Reading {notes.txt} now"}
    events = [*events_of(message, "stop")[:-2], b'data: {"error": {"code": 503, "message": "overloaded"}}\n\n']
    sent, _, repair = stream(message, "stop", events=events)
    assert repair is not None and repair.parse_error is None
    assert b"".join(sent).endswith(events[-1]) and client_view(sent)[0] == message["content"]
