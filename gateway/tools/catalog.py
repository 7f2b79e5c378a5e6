"""The file tools' catalog as the model sees it (names, descriptions, parameters), and the demo's prompts.

The specs live apart from the implementations (gateway.tools.files) so that token
counts, policies and the demo all describe the tools the same way.
"""

from __future__ import annotations

from gateway.harness.tools import ToolSpec

# Calibrated with gateway.tokens so the `plan` run's first prompt is 204
# tokens (system + task + the four FILE_TOOLS); edit the wording, re-check the figures.
SYSTEM_PROMPT = "You look after a folder of log files. Use the tools to look before you answer, in one sentence."

PLAN_TASK = "Which file mentions a timeout?"

LIST_FILES = ToolSpec(
    name="list_files",
    description="List the files in the working folder with their sizes.",
    parameters={"type": "object", "properties": {}},
    read_only=True,
)
READ_FILE = ToolSpec(
    name="read_file",
    description="Read a text file from the working folder.",
    parameters={
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    },
    read_only=True,
)
DELETE_FILE = ToolSpec(
    name="delete_file",
    description="Delete a file from the working folder. Needs a person's approval.",
    parameters={
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    },
    read_only=False,
    needs_approval=True,
    destructive=True,
)
SCAN_ARCHIVE = ToolSpec(
    name="scan_archive",
    description="Scan the log archive for errors. Slow; reports progress.",
    parameters={"type": "object", "properties": {}},
    read_only=True,
)
RESEARCH = ToolSpec(
    name="research",
    description="Investigate one question and return a short summary.",
    parameters={
        "type": "object",
        "properties": {"question": {"type": "string"}},
        "required": ["question"],
    },
    read_only=True,
)

FILE_TOOLS: tuple[ToolSpec, ...] = (LIST_FILES, READ_FILE, DELETE_FILE, SCAN_ARCHIVE)

RESEARCH_SYSTEM = (
    "You are a research assistant. Investigate the question with the file tools and "
    "reply with a short summary of what you found."
)
