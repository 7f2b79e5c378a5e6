"""llama.cpp's own OpenAI-compatible HTTP server, in process, through xllamacpp.

`xllamacpp.Server(params)` binds the port, loads the model and returns once it is loaded;
its HTTP threads then serve /v1/chat/completions, /v1/models and /health until the object
is released. We add what a command needs around it: a clear error when the runtime is not
installed or the port is taken, a readiness probe that waits for a real answer, and stop().
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from gateway.local.model import LocalSetupError

RUNTIME_HINT = "pip install '.[local]'"


class RuntimeMissingError(LocalSetupError):
    """The llama.cpp runtime (xllamacpp) is not installed."""


class ServerStartError(LocalSetupError):
    """llama.cpp refused to start (port taken, unreadable model...)."""


def load_runtime() -> ModuleType:
    """The xllamacpp module, or a RuntimeMissingError saying what to install."""
    try:
        import xllamacpp
    except ImportError as exc:
        raise RuntimeMissingError(
            f"the local model runtime xllamacpp is not installed ({exc}); run: {RUNTIME_HINT}"
        ) from None
    module: ModuleType = xllamacpp
    return module


@dataclass(frozen=True)
class ServerSettings:
    """Everything the local server is started with."""

    model_path: Path
    alias: str
    chat_template: str
    host: str = "127.0.0.1"
    port: int = 8081
    threads: int = 2
    n_ctx: int = 4096
    # llama.cpp reuses the longest cached prefix of the last prompt and evaluates only the rest, in
    # other batches than a fresh evaluation would: the logits differ in the last bits, and greedy
    # decoding picks another token where two are nearly tied. Off, every prompt is evaluated whole
    # (slower), so the same prompt gets the same answer whatever the server was asked before.
    prompt_cache: bool = True


def _probe_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _port_in_use(host: str, port: int) -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return True
    return False


class LocalServer:
    """One llama.cpp server; start() blocks until the model is loaded, stop() releases it."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._server: Any = None
        self._address = ""

    def start(self) -> None:
        """Load the model and listen; raises ServerStartError with the likely cause."""
        xllamacpp = load_runtime()
        s = self.settings
        params = xllamacpp.CommonParams()
        params.model.path = str(s.model_path)
        params.model_alias = {s.alias}
        params.hostnames = [s.host]
        params.port = s.port
        params.n_ctx = s.n_ctx
        params.n_parallel = 1  # one slot: on two cores a second concurrent request only slows both
        params.cpuparams.n_threads = s.threads
        params.cpuparams_batch.n_threads = s.threads
        params.cache_prompt = s.prompt_cache  # the default of each request's `cache_prompt`
        params.use_jinja = True  # needed for tools; also lets chat_template be a Jinja text
        params.chat_template = s.chat_template
        params.ui = False
        try:
            self._server = xllamacpp.Server(params)
        except RuntimeError as exc:
            if s.port and _port_in_use(s.host, s.port):
                cause = f"port {s.port} on {s.host} is already in use (pick another with --port)"
            else:
                cause = f"llama.cpp could not start on {s.host}:{s.port} with {s.model_path} (see its log above)"
            raise ServerStartError(f"{cause}: {exc}") from None
        self._address = str(self._server.listening_address)

    @property
    def root_url(self) -> str:
        """http://host:port as llama.cpp reports it (the real port even when 0 was asked)."""
        if not self._address:
            raise RuntimeError("the server is not started")
        return self._address.rstrip("/")

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients should use."""
        return self.root_url + "/v1"

    def probe_url(self) -> str:
        """The base URL as reachable from this machine (0.0.0.0 becomes 127.0.0.1)."""
        scheme, _, rest = self.root_url.partition("://")
        host, _, port = rest.rpartition(":")
        probe = _probe_host(host.strip("[]"))
        return f"{scheme}://{f'[{probe}]' if ':' in probe else probe}:{port}/v1"

    def wait_ready(self, timeout: float = 60.0) -> list[str]:
        """Poll /v1/models until it answers 200; return the model ids it lists."""
        url = self.probe_url() + "/models"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    body = json.load(resp)
                return [str(m["id"]) for m in body.get("data", [])]
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                if time.monotonic() > deadline:
                    raise ServerStartError(f"{url} did not answer within {timeout:.0f}s") from None
                time.sleep(0.05)  # readiness polling interval

    def stop(self) -> None:
        """Stop serving: releasing the object joins llama.cpp's main loop."""
        self._server = None
        self._address = ""

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
