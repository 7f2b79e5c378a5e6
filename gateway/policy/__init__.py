"""Policies: YAML files that declare limits, a tool catalog, error wording, dedupe, stop
conditions and approval rules, loaded into frozen `Policy` objects and compiled into the
harness's `RunOptions`.

Modules: `schema` (load and validate a file), `registry` (the reloadable set),
`approval` (rules -> verdicts, approvers, expiry), `executors` (python/http/agent tools
and `compile_options`), `check` (`gateway policy check`).
"""
