"""Test sessions. ``uv run nox`` runs the CPU sessions and the repository checks.

CPU sessions build a fresh venv per package from the workspace lock (``uv sync --locked``), so each
layer is tested with only what it declares. GPU sessions (``nox -s "gpu(kernels, h200)"``)
run without a venv against the runner's preinstalled torch, through ``ci/gpu.py``.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "lint",
    "layers",
    "pins",
    "tests",
    "megatron",
]
PY = "3.12"
PACKAGES = ["runtime", "kernels", "ep"]
# The version the SwiGLU seed's figures were measured against, and the newest release.
MEGATRON_VERSIONS = ["0.16.1", "0.19.2"]


def _sync(session: nox.Session, package: str) -> None:
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--package",
        f"lck-{package}",
        "--group",
        "test",
        "--no-default-groups",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _pytest(session: nox.Session, package: str, *extra: str) -> None:
    env = {
        # CPU CI: Triton kernels run in its interpreter; GPU-marked tests skip with their reason.
        "TRITON_INTERPRET": "1",
        "PYTHONFAULTHANDLER": "1",
        "LCK_JIT_CACHE_DIR": os.path.join(session.create_tmp(), "jit-cache"),
        "EP_JIT_CACHE_DIR": os.path.join(session.create_tmp(), "ep-jit-cache"),
    }
    session.run(
        "python",
        "-m",
        "pytest",
        f"packages/lck-{package}/tests",
        "-ra",
        "-q",
        "-p",
        "no:cacheprovider",
        *extra,
        *session.posargs,
        env=env,
    )


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=False)
def layers(session: nox.Session) -> None:
    """Fail on any upward or sideways import between members, and on any import cycle inside them."""
    session.run("python", "ci/checks.py", "layers")
    session.run("python", "ci/checks.py", "cycles")
    session.run("python", "-m", "pytest", "tests/test_checks.py", "-q", "-p", "no:cacheprovider")


@nox.session(python=False)
def pins(session: nox.Session) -> None:
    """Fail when a meta-package pin differs from the member's version (uv does not check this)."""
    session.run("python", "ci/checks.py", "pins")


@nox.session(python=PY)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    _sync(session, package)
    _pytest(session, package)


@nox.session(python=PY)
@nox.parametrize("version", MEGATRON_VERSIONS, ids=MEGATRON_VERSIONS)
def megatron(session: nox.Session, version: str) -> None:
    _sync(session, "megatron")
    if version != MEGATRON_VERSIONS[-1]:
        session.install(f"megatron-core=={version}")
    # Package metadata, not megatron.core.__version__ (which appends the commit of the cwd's git repo).
    check = f"from importlib.metadata import version as v; assert v('megatron-core') == '{version}', v('megatron-core')"
    session.run("python", "-c", check)
    _pytest(session, "megatron")


@nox.session(python=False)
@nox.parametrize("runner", ["h200", "b300"], ids=["h200", "b300"])
@nox.parametrize("package", [*PACKAGES, "megatron"], ids=[*PACKAGES, "megatron"])
def gpu(session: nox.Session, package: str, runner: str) -> None:
    """GPU-marked tests of one layer on a runner, with its preinstalled torch (no venv, no network)."""
    session.run("python3", "ci/gpu.py", "--package", package, "--runner", runner, *session.posargs)
