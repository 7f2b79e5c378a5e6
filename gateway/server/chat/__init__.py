"""`POST /v1/chat/completions`: the endpoint and its two modes side by side.

- `passthrough`: the call goes to the upstream and its turn is booked (`passthrough_stream`
  when streamed: `stream_events` reads the events and writes them on, `stream_repair`
  repairs their tool calls);
- `server_side`: a policy with tools runs the whole loop in the gateway (`answers` is what
  the run answers).
"""
