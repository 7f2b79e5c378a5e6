"""A request's headers, checked once at the edge, before any handler reads one.

aiohttp decodes header bytes as UTF-8 with `surrogateescape`: a byte that is not UTF-8
becomes a lone surrogate in the `str` a handler reads, and fails later wherever the value
is encoded, hashed, compared or rendered (a key's digest, the console's HMAC, an upstream
request, the JSON of an error that quotes it). So every header name and value must be
UTF-8 text, and a request with one that is not is refused here, by the middleware of
every listener: 401 `invalid_api_key` when it is `Authorization` (the caller cannot be
identified), else 400 `invalid_header` naming the header. The bytes are never echoed.
(The HTTP parser already refuses control bytes and line breaks, `listener.parser_error`.)
Handlers then read `request.headers` as valid text, with no checks of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.server.http.errors import BadRequest, Unauthorized


def check(raw_headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Refuse the request unless every header name and value is UTF-8 (`request.raw_headers`)."""
    for name, value in raw_headers:
        if name.isascii() and value.isascii():  # nearly always: one scan of each, no decoding
            continue
        try:
            text = name.decode()
        except UnicodeDecodeError:
            raise BadRequest("a header name is not UTF-8 text", code="invalid_header") from None
        try:
            value.decode()
        except UnicodeDecodeError:
            if text.lower() == "authorization":
                raise Unauthorized("malformed Authorization header: it is not UTF-8 text; "
                                   "expected 'Bearer <key>'") from None
            raise BadRequest(f"header {text} is not UTF-8 text", code="invalid_header", param=text) from None
