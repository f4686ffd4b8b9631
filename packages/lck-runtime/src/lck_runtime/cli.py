"""The ``lck`` console script.

Subcommands come from installed layers through the ``lck.commands`` entry-point group
(name → ``main(argv) -> int``). ``lck bench <layer>`` is owned here and dispatches to the
``lck.bench`` group, so several layers can contribute benchmarks without fighting over a name.
A layer that is not installed contributes nothing: its commands are simply absent. ``doctor`` is this
layer's own and always present, so that a checkout used through ``PYTHONPATH`` (no entry points, as on
the GPU runners) can still say what it sees; an unknown command there names the modules to run instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version

Command = Callable[[list[str]], int]


# What the layers register at install time, for the hint shown when they are only on the path.
_MODULES = "python -m lck_megatron.demo, python -m lck_kernels.bench, python -m lck_ep.benchmark"


def _group(name: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=name)}


def _commands() -> dict[str, EntryPoint]:
    commands = _group("lck.commands")
    commands.setdefault("doctor", EntryPoint("doctor", "lck_runtime.doctor:main", "lck.commands"))
    return commands


def _installed() -> bool:
    try:
        version("lck-runtime")
    except PackageNotFoundError:
        return False
    return True


def _not_installed_hint() -> str:
    if _installed():
        return ""
    return (
        "\n\nlck-runtime is imported from the path, not installed, so the layers' commands (registered at "
        f"install time) are missing: install them (uv sync, or pip install -e each package) or run {_MODULES}"
    )


def _summary(ep: EntryPoint) -> str:
    try:
        doc = ep.load().__doc__ or ""
    except Exception as exc:  # a broken layer must not hide the others
        return f"(unavailable: {type(exc).__name__}: {exc})"
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _usage(commands: dict[str, EntryPoint], benches: dict[str, EntryPoint]) -> str:
    lines = ["usage: lck <command> [args...]", "", "commands:"]
    for name in sorted(commands):
        lines.append(f"  {name:<10} {_summary(commands[name])}")
    if benches:
        lines.append(f"  {'bench':<10} time lck against its peers: lck bench {{{','.join(sorted(benches))}}}")
    return "\n".join(lines)


def bench(argv: list[str]) -> int:
    """Time lck against its peers; `lck bench <layer> --help` for a layer's options."""
    benches = _group("lck.bench")
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: lck bench {{{','.join(sorted(benches)) or 'no layer installed'}}} [args...]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in benches:
        avail = ", ".join(sorted(benches)) or "none (install lck-kernels or lck-ep)"
        print(
            f"lck bench: unknown layer {name!r}; installed: {avail}{_not_installed_hint()}", file=sys.stderr
        )
        return 2
    return int(benches[name].load()(rest) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    benches = _group("lck.bench")
    if not args or args[0] in ("-h", "--help"):
        print(_usage(commands, benches))
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name == "bench" and benches:
        return bench(rest)
    if name not in commands:
        print(
            f"lck: unknown command {name!r}\n\n{_usage(commands, benches)}{_not_installed_hint()}",
            file=sys.stderr,
        )
        return 2
    return int(commands[name].load()(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
