"""`gateway local`: assemble the local Qwen model once, then serve it until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from gateway.local.model import MODELS, LocalSetupError, default_cache_dir, ensure_model
from gateway.local.server import LocalServer, ServerSettings, load_runtime
from gateway.local.template import TEMPLATES, write_template

N_CTX = 4096


def _say(message: str) -> None:
    print(f"gateway local: {message}", file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.model not in MODELS:
        return f"--model must be one of {', '.join(MODELS)}, not {args.model!r}"
    if not 0 <= args.port <= 65535:
        return f"--port must be between 0 and 65535, not {args.port}"
    if args.threads < 1:
        return f"--threads must be at least 1, not {args.threads}"
    return None


class _Interrupted(Exception):
    """SIGTERM/SIGINT while preparing the model: unwind, so assembly deletes its temp file."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Stopper:
    """The signal handler: raises while preparing (Python code, safe to unwind), sets an event once serving."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.raising = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()
        if self.raising:
            raise _Interrupted(signum)


def local_command(args: argparse.Namespace) -> int:
    """Serve `args.model` on http://host:port/v1 until SIGTERM/SIGINT.

    Returns 0 after a clean stop, 2 on a setup error, 128+signal if stopped while preparing.
    """
    problem = _check_args(args)
    if problem:
        _say(problem)
        return 2
    spec = MODELS[args.model]
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    stopper = _Stopper()
    previous = {sig: signal.signal(sig, stopper) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        started = time.monotonic()
        try:
            load_runtime()  # fail before spending time on a 0.5-1 GB assembly
            model_path = ensure_model(spec, cache_dir, log=_say)
            template_path = write_template(cache_dir, spec.template)
            # From here the server's C code runs: a signal only sets the event, checked below.
            stopper.raising = False
        except _Interrupted as exc:
            _say(f"interrupted ({exc}) while preparing the model")
            return 128 + exc.signum
        except LocalSetupError as exc:
            _say(str(exc))
            return 2
        except OSError as exc:
            _say(f"cannot prepare the model in {cache_dir}: {exc} (choose another folder with --cache-dir)")
            return 2
        _say(f"loading {model_path} with template {template_path}")
        server = LocalServer(ServerSettings(
            model_path=model_path, alias=spec.name, chat_template=TEMPLATES[spec.template][1],
            host=args.host, port=args.port, threads=args.threads, n_ctx=N_CTX,
            prompt_cache=not getattr(args, "no_prompt_cache", False),
        ))
        try:
            server.start()
            names = server.wait_ready() if not stopper.event.is_set() else []
        except LocalSetupError as exc:
            server.stop()
            _say(str(exc))
            return 2
        if names:
            _say(f"ready in {time.monotonic() - started:.1f}s")
            # Exact wording relied upon by scripts: "local model ready at <base_url> (<model ids>)".
            print(f"local model ready at {server.base_url} ({', '.join(names)})", flush=True)
        stopper.event.wait()
        server.stop()
        _say("stopped")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
