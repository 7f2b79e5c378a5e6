"""The HTTP edge, shared by every endpoint: errors in the OpenAI shape, the middleware,
authentication, request bodies read and checked once, run headers, server-sent events and
the listener. A leaf of the server: it imports no endpoint and no run rule."""
