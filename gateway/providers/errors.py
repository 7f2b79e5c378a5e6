"""How an upstream call fails, in the providers' own terms (the server maps these to HTTP).

    UpstreamError        one failure of one upstream call; `code` says which:
                         upstream_timeout | upstream_unreachable | upstream_cut |
                         upstream_misconfigured | upstream_malformed | upstream_status
                         (a 401/403/429/5xx answer) | upstream_rejected (another 4xx) |
                         upstream_error (an error event inside a stream) |
                         upstream_unavailable (every deployment of a route is cooling down) |
                         content_filter (a 4xx whose error.code is content_filter: the upstream's
                         content filter refused the prompt, e.g. Azure OpenAI's; `detail` holds its
                         param and innererror, passed on to the client)

How each code is retried or failed over is `failover.outcome_of`'s: content_filter, like any
rejection, is never retried nor sent to another deployment or fallback (that would route
around a safety filter), and leaves the deployment healthy.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.harness.trace import UpstreamAttemptFields

UpstreamCode = Literal["upstream_timeout", "upstream_unreachable", "upstream_cut", "upstream_misconfigured",
                       "upstream_malformed", "upstream_status", "upstream_rejected", "upstream_error",
                       "upstream_unavailable", "content_filter"]


class UpstreamError(Exception):
    """An upstream call failed. `upstream_status` is the upstream's own HTTP status when it
    answered one (200 for a malformed body or a broken stream), None when it never answered."""

    def __init__(self, code: UpstreamCode, message: str, upstream: str, upstream_status: int | None = None,
                 retry_after_s: float | None = None, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code: UpstreamCode = code
        self.message = message
        self.upstream = upstream
        self.upstream_status = upstream_status
        self.retry_after_s = retry_after_s  # what the upstream asked for (its retry-after), for the router
        self.detail = detail  # fields of the upstream's error the client gets too (content_filter's)
        self.attempts: list[UpstreamAttemptFields] = []  # a server-side turn's attempts, for the run's trace
