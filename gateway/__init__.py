"""gateway: an OpenAI-compatible proxy that governs LLM agent runs."""

__version__ = "0.1.0"
