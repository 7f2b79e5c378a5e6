"""`gateway demo [--json] [--only NAME]`: run the experiments and print one line each."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import aiohttp

from gateway.demo import resume
from gateway.demo.experiments import EXPERIMENTS, Experiment
from gateway.demo.lab import Lab, serve_scripted, workdir
from gateway.demo.report import Result

ALL: dict[str, Experiment] = {**EXPERIMENTS, "resume": resume.experiment}
ORDER = ["plan", "runaway", "budget", "recover", "forbidden", "repeat", "destructive", "resume", "cancel",
         "latency", "research"]


async def run_experiments(names: list[str], emit: bool = True, as_json: bool = False) -> list[Result]:
    """Run the named experiments against a fresh scripted provider; print as they finish."""
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise SystemExit(f"gateway demo: unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(ORDER)}")
    runner, base_url = await serve_scripted()
    results: list[Result] = []
    try:
        with workdir() as tmp:
            async with aiohttp.ClientSession() as session:
                lab = Lab(session, base_url, Path(tmp))
                for name in names:
                    for result in await ALL[name](lab):
                        results.append(result)
                        if emit:
                            print(result.json() if as_json else result.line(), flush=True)
    finally:
        await runner.cleanup()
    return results


def demo_command(args: argparse.Namespace) -> int:
    if args.local:
        from gateway.demo.local import local_demo

        return local_demo(args)
    names = args.only or ORDER
    asyncio.run(run_experiments(names, as_json=args.json))
    return 0


if __name__ == "__main__":
    sys.exit(demo_command(argparse.Namespace(local=False, only=sys.argv[1:], json=False)))
