"""Command line: ``python -m extsrc {demo,bench,doctor}``.

Each command lives in its own module and exposes ``main(argv) -> int``; this
module only dispatches, so ``python -m extsrc --help`` stays fast and imports
nothing heavy.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("extsrc.cli.demo", "decode the bundled image set through a DALI pipeline fed by extsrc"),
    "bench": ("extsrc.cli.bench", "measure extsrc side by side with its peers and print ratios"),
    "doctor": ("extsrc.cli.doctor", "check shared memory, start methods, CUDA, DALI and CuPy"),
}


def _usage() -> str:
    lines = ["usage: python -m extsrc <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'python -m extsrc <command> --help' for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the command named by ``argv[0]``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"extsrc: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)
