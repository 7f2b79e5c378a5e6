"""The chat templates the local server renders prompts with: Qwen2.5's own, minus `<tool_call>` tags.

With the GGUF's template, Qwen writes tool calls as JSON wrapped in `<tool_call>` tags and
this llama.cpp build hands that back as plain `content`. With the same template minus the
tags (in the tool instructions and when replaying past assistant calls), llama.cpp parses
the bare JSON into proper `tool_calls` with finish_reason "tool_calls", streaming too.
Qwen2.5-Coder 0.5B and 1.5B share this template (ChatML), and so does SmolLM2, whose own
template is ChatML without tools.

`GEMMA_TEMPLATE` is the same tool instructions in Gemma's turn markup (no system role: the
system text and the tools open the first user turn). The Gemma GGUF that packages ship
carries no template at all, and llama.cpp's fallback renders no tools.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final, Literal

TemplateKind = Literal["chatml", "gemma"]
TEMPLATE_FILENAME: Final = "qwen2.5-tools-bare-json.jinja"

CHAT_TEMPLATE: Final = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments:\n{\"name\": <function-name>, \"arguments\": <args-json-object>}<|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}'''


GEMMA_TEMPLATE: Final = r'''{{- bos_token }}
{%- set first_user = namespace(done=false) %}
{%- for message in messages %}
    {%- if message.role == "system" %}
    {%- elif message.role == "user" and not first_user.done %}
        {%- set first_user.done = true %}
        {{- '<start_of_turn>user\n' }}
        {%- if messages[0]['role'] == 'system' %}
            {{- messages[0]['content'] + '\n\n' }}
        {%- endif %}
        {%- if tools %}
            {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
            {%- for tool in tools %}
                {{- "\n" }}
                {{- tool | tojson }}
            {%- endfor %}
            {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments:\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n\n" }}
        {%- endif %}
        {{- message.content + '<end_of_turn>\n' }}
    {%- elif message.role == "user" %}
        {{- '<start_of_turn>user\n' + message.content + '<end_of_turn>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<start_of_turn>model' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}' }}
        {%- endfor %}
        {{- '<end_of_turn>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<start_of_turn>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<end_of_turn>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}'''

TEMPLATES: Final[dict[TemplateKind, tuple[str, str]]] = {
    "chatml": (TEMPLATE_FILENAME, CHAT_TEMPLATE),
    "gemma": ("gemma3-tools-bare-json.jinja", GEMMA_TEMPLATE),
}
"""Each template kind's file name in the cache and its text."""


def write_template(folder: Path, kind: TemplateKind = "chatml") -> Path:
    """Write the template of `kind` into `folder` (atomically, only if it changed) and return its path."""
    filename, text = TEMPLATES[kind]
    path = folder / filename
    if path.exists() and path.read_text() == text:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
