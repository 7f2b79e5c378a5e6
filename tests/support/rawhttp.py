"""HTTP/1.1 requests written to a socket byte for byte: header names and values a client
library would refuse or re-encode (bytes that are not UTF-8, odd names) reach the server
exactly as given."""

from __future__ import annotations

import http.client
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


def send(url: str, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"",
         timeout: float = 60) -> Answer:
    """One request on a connection of its own to `url` (http://host:port); a `Host` header
    is added unless `headers` has one."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = [f"{method} {path} HTTP/1.1".encode(), b"Connection: close", f"Content-Length: {len(body)}".encode()]
    if not any(name.lower() == b"host" for name, _ in headers):
        head.append(f"Host: {host}:{port}".encode())
    head += [name + b": " + value for name, value in headers]
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        data = resp.read()
        return Answer(resp.status, resp.getheader("Content-Type") or "", data)
