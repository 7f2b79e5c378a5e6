"""The `mcp:` section of a policy file: servers whose tools are discovered at load time.

Each entry names a server (stdio `command` or streamable HTTP `url`) and which of its tools
to take (`include`/`exclude` globs on the server's names, then `rename` or `prefix`).
Discovery (`tools/list`, through the process's `McpHub`) turns each taken tool into a
`ToolDecl`: its JSON schema checks arguments like a hand-declared tool's `parameters`,
its annotations set `read_only` (readOnlyHint) and `destructive` (destructiveHint, or no
hint on a tool that is not read-only). A `tools:` entry without an `executor` overrides
a discovered tool of that name: description, timeout_s, read_only, destructive,
needs_approval.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import orjson

from gateway.harness.tools import ToolSpec
from gateway.mcp.config import McpServerConfig, McpToolInfo
from gateway.mcp.hub import McpHub, McpUnavailable
from gateway.policy.decl import TOOL_NAME, McpExecutor, ToolDecl
from gateway.policy.errors import PolicyError
from gateway.policy.source import At, Fields, Source

SERVER_FIELDS = ("name", "command", "url", "env", "cwd", "headers_env", "include", "exclude", "prefix", "rename",
                 "timeout_s", "max_result_chars", "optional")
OVERRIDE_FIELDS = ("name", "description", "read_only", "destructive", "needs_approval", "timeout_s")
MAX_RESULT_CHARS_CAP = 1_000_000
MAX_DESCRIPTION = 4096
"""A discovered description is cut here: it is the server's text, read by every model turn."""
MAX_SCHEMA_BYTES = 65_536
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolOverride:
    """A `tools:` entry without an executor: fields that replace a discovered tool's."""

    at: At
    name: str
    fields: dict[str, Any]


def _strings(at: At, what: str) -> tuple[str, ...]:
    if not isinstance(at.value, list) or not at.value:
        at.fail(f"must be a non-empty list of {what}")
    return tuple(item.string() for item in at.items())


def _pairs(at: At, what: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(at.value, dict):
        at.fail(f"must be a mapping of {what}")
    return tuple((str(k), at.child(str(k), v).string(non_empty=False)) for k, v in at.value.items())


def parse_servers(at: At | None, base_dir: Path) -> list[tuple[McpServerConfig, At]]:
    """The `mcp:` entries, each with where it was written (for errors found at discovery)."""
    if at is None:
        return []
    servers: list[tuple[McpServerConfig, At]] = []
    for item in at.items():
        f = item.fields(SERVER_FIELDS, required=("name",))
        name_at = f.req("name")
        name = name_at.string()
        if not _NAME.match(name):
            name_at.fail("an MCP server name holds 1 to 64 letters, digits, '_', '-' or '.'")
        if any(s.name == name for s, _ in servers):
            name_at.fail(f"MCP server '{name}' is listed twice")
        if f.has("command") == f.has("url"):
            item.fail("an MCP server names exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
        command: tuple[str, ...] = ()
        url = None
        if (c := f.get("command")) is not None:
            command = _strings(c, "program and arguments")
        if (u := f.get("url")) is not None:
            url = u.string()
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                u.fail(f"'{url}' is not an http:// or https:// URL")
        if url is not None:
            for key in ("env", "cwd"):
                if f.has(key):
                    item.child(key, None).fail(f"'{key}' is for a stdio server (command); this one has a url")
        if command and f.has("headers_env"):
            item.child("headers_env", None).fail("'headers_env' is for an HTTP server (url); this one has a command")
        cwd = None
        if (w := f.get("cwd")) is not None:
            cwd = str((base_dir / w.string()).resolve())
        rename: tuple[tuple[str, str], ...] = ()
        if (r := f.get("rename")) is not None:
            rename = _pairs(r, "server tool name to the name the model sees")
            for key, new in rename:
                if not TOOL_NAME.match(new):
                    r.child(key, new).fail("a tool name holds 1 to 64 letters, digits, '_' or '-'")
        max_chars = None
        if (m := f.get("max_result_chars")) is not None:
            max_chars = m.positive_int()
            if max_chars > MAX_RESULT_CHARS_CAP:
                m.fail(f"must be at most {MAX_RESULT_CHARS_CAP}")
        config = McpServerConfig(
            name=name, command=command, url=url, cwd=cwd,
            env=_pairs(e, "variable name to value") if (e := f.get("env")) else (),
            headers_env=_pairs(h, "header name to environment variable") if (h := f.get("headers_env")) else (),
            include=_strings(i, "globs") if (i := f.get("include")) else ("*",),
            exclude=_strings(x, "globs") if (x := f.get("exclude")) else (),
            prefix=p.string(non_empty=False) if (p := f.get("prefix")) else "",
            rename=rename,
            timeout_s=t.positive_number() if (t := f.get("timeout_s")) else None,
            **({"max_result_chars": max_chars} if max_chars is not None else {}),
            optional=o.boolean() if (o := f.get("optional")) is not None else False,
        )
        if url is not None:
            try:
                config.headers()
            except LookupError as exc:
                item.child("headers_env", None).fail(str(exc))
        servers.append((config, item))
    return servers


def start_servers(files: Sequence[Path], hub: McpHub) -> None:
    """Start the MCP servers the files name, all at once, before their policies are loaded
    one by one (each load then finds its servers started). A file that does not parse is
    skipped here; its load reports why."""
    for file in files:
        try:
            root = Source(str(file), file.read_text("utf-8")).root()
            if isinstance(root.value, dict):
                for config, _ in parse_servers(Fields(root).get("mcp"), file.parent):
                    hub.start_soon(config)
        except (PolicyError, OSError, UnicodeDecodeError):
            continue


def parse_override(at: At) -> ToolOverride:
    f = at.fields(OVERRIDE_FIELDS, required=("name",))
    fields: dict[str, Any] = {}
    if (d := f.get("description")) is not None:
        fields["description"] = d.string()
    for flag in ("read_only", "destructive", "needs_approval"):
        if (b := f.get(flag)) is not None:
            fields[flag] = b.boolean()
    if (t := f.get("timeout_s")) is not None:
        fields["timeout_s"] = t.positive_number()
    return ToolOverride(at, f.req("name").string(), fields)


def _schema(tool: McpToolInfo, at: At) -> dict[str, Any]:
    schema = dict(tool.input_schema) or {"type": "object", "properties": {}}
    if len(orjson.dumps(schema, default=str)) > MAX_SCHEMA_BYTES:
        at.fail(f"the input schema of MCP tool '{tool.name}' is over {MAX_SCHEMA_BYTES} bytes; exclude the tool")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        at.fail(f"MCP tool '{tool.name}' has an invalid input schema ({exc.message}); exclude the tool")
    if schema.get("type") != "object":
        at.fail(f"the input schema of MCP tool '{tool.name}' is not type: object; exclude the tool")
    return schema


def _description(text: str) -> str:
    return text if len(text) <= MAX_DESCRIPTION else text[:MAX_DESCRIPTION - 3] + "..."


def discover(servers: Sequence[tuple[McpServerConfig, At]], hub: McpHub | None,
             taken: set[str]) -> tuple[list[ToolDecl], list[dict[str, Any]]]:
    """The tools of every server, as declarations, and what discovery found (for the version).

    `taken` are the names of hand-declared tools; a discovered tool may not reuse one."""
    decls: list[ToolDecl] = []
    found: list[dict[str, Any]] = []
    for config, at in servers:
        if hub is None:
            at.fail("MCP servers are discovered by a gateway process; this loader has no MCP hub")
        try:
            tools = hub.discover(config)
        except McpUnavailable as exc:
            at.fail(f"cannot discover the tools of MCP server '{config.name}': {exc}")
        offered = {t.name for t in tools}
        for key, _ in config.rename:
            if key not in offered:
                at.child("rename", None).child(key, None).fail(
                    f"MCP server '{config.name}' has no tool '{key}' (it offers: {', '.join(sorted(offered))})")
        taken_here = [t for t in tools if config.takes(t.name)]
        if not taken_here:
            at.fail(f"MCP server '{config.name}' offers no tool that include/exclude let through "
                    f"(it offers: {', '.join(sorted(offered)) or 'none'})")
        for tool in taken_here:
            name = config.exposed_name(tool.name)
            if not TOOL_NAME.match(name):
                at.fail(f"MCP tool '{tool.name}' would be called '{name}', not a valid tool name (1 to 64 letters, "
                        f"digits, '_' or '-'); rename or exclude it")
            if name in taken:
                at.fail(f"MCP tool '{tool.name}' would be called '{name}', which another tool of this policy "
                        f"already is; use prefix, rename or exclude")
            taken.add(name)
            spec = ToolSpec(name=name, description=_description(tool.description or f"{tool.name} ({config.name})"),
                            parameters=_schema(tool, at), read_only=tool.read_only, destructive=tool.destructive,
                            timeout_s=config.timeout_s)
            decls.append(ToolDecl(spec=spec, executor=McpExecutor(config, tool.name, hub)))
            found.append({"server": config.name, "as": name, **tool.to_json()})
    return decls, found


def apply_overrides(decls: list[ToolDecl], overrides: Sequence[ToolOverride]) -> list[ToolDecl]:
    """Discovered tools with the fields their override entries set."""
    by_name = {d.name: i for i, d in enumerate(decls)}
    out = list(decls)
    for o in overrides:
        i = by_name.get(o.name)
        if i is None:
            known = ", ".join(d.name for d in decls) or "none"
            o.at.fail(f"tool '{o.name}' has no executor, so it must name a tool discovered on an MCP server "
                      f"(discovered: {known})")
        fields = dict(o.fields)
        if fields.get("read_only") is True:  # a tool that changes nothing destroys nothing
            fields.setdefault("destructive", False)
        out[i] = replace(out[i], spec=replace(out[i].spec, **fields))
    return out


def version_input(raw: bytes, found: list[dict[str, Any]]) -> bytes:
    """What a policy's version hashes: the file, and the tools discovered on its servers (so a
    reload that finds other tools makes a new version, and runs keep their own list)."""
    return raw + (orjson.dumps(found, option=orjson.OPT_SORT_KEYS) if found else b"")
