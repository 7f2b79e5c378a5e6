"""MCP servers as a tool source: one client session per server per gateway process.

`config` holds what a policy says about a server (transport, filters, names), `hub` runs
the sessions (on a thread of their own, so policy loading can discover tools
synchronously), `content` turns a tool result into the text the model reads.
Nothing here imports the policy layer or the server.
"""
