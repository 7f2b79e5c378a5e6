"""The management APIs: runs (list, read, trace, approve, resume, cancel) with their access
table, the admin API (policy reload) and `GET /metrics`."""
