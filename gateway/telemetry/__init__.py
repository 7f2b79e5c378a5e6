"""What an operator sees of the gateway beyond its metrics: traces and the access log.

```
telemetry/
  tracing.py     OpenTelemetry traces over OTLP/HTTP (docs/telemetry.md): the process's tracer,
                 W3C propagation, and every span the gateway makes, named and attributed per the
                 GenAI semantic conventions. Imported only when `telemetry.otlp_endpoint` is set:
                 it needs the `otel` extra (opentelemetry-sdk, the OTLP/HTTP exporter, the
                 semantic conventions); a gateway without it runs unchanged.
  access_log.py  one structured line per request (JSON or logfmt), to stderr or a rotated file.
```

The layers below the server (providers, policy, mcp) never import this package: they take
a `propagate(headers)` callable (None while tracing is off) and, for upstream attempts,
`providers.failover.AttemptTracer`; the server wires them to the `Tracing` of its app.
"""
