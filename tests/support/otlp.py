"""A real OTLP/HTTP trace receiver for tests: what a collector would be sent, decoded.

`receiving()` serves `POST /v1/traces` on a free loopback port, in a thread of its own, and
decodes each export (protobuf, maybe gzipped) with `opentelemetry-proto`, as a collector
does. `Receiver.spans` are the spans received so far, flattened with their resource's
attributes; `wait_for` polls for a condition with a deadline (the exporter sends in
batches, on its own schedule).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.support.upstreams import in_thread

EXPORT_WAIT_S = 60.0


def value(v: AnyValue) -> Any:
    """An OTLP attribute value as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind is not None else None


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Event:
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One received span, its ids as hex."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: tuple[Event, ...]
    links: tuple[Link, ...]
    status: int
    start_ns: int
    end_ns: int
    resource: dict[str, Any]

    def attr(self, key: str) -> Any:
        return self.attributes.get(key)


@dataclass
class Receiver:
    url: str = ""
    spans: list[Span] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), attributes={kv.key: value(kv.value) for kv in s.attributes},
                        events=tuple(Event(e.name, {kv.key: value(kv.value) for kv in e.attributes}) for e in s.events),
                        links=tuple(Link(lk.trace_id.hex(), lk.span_id.hex(),
                                         {kv.key: value(kv.value) for kv in lk.attributes}) for lk in s.links),
                        status=s.status.code, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        resource=resource))
        with self.lock:
            self.spans.extend(got)
            self.headers.append(headers)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, found: Callable[[list[Span]], Any], timeout: float = EXPORT_WAIT_S) -> Any:
        """Poll the received spans until `found(spans)` is truthy; return what it returned."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            result = found(spans)
            if result:
                return result
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise TimeoutError(f"spans not received within {timeout}s; have {len(spans)}: {names}")
            time.sleep(0.05)  # the exporter's batches arrive when they arrive: poll, with a deadline


@contextmanager
def receiving() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on loopback; its `url` is the base to configure (`/v1/traces` under it)."""
    receiver = Receiver()

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        receiver.add(export, {k.lower(): v for k, v in request.headers.items()})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def make() -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", traces)
        return app

    with in_thread(make) as url:
        receiver.url = url
        yield receiver
