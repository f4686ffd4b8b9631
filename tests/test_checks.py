"""The layer, cycle and pin checks catch what they claim to, and the repository passes them."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lck_ci_checks", ROOT / "ci" / "checks.py")
checks = importlib.util.module_from_spec(_spec)
sys.modules["lck_ci_checks"] = checks
_spec.loader.exec_module(checks)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the repository's pyprojects with one empty module per member."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for dist, imp in (
        ("lck-runtime", "lck_runtime"),
        ("lck-kernels", "lck_kernels"),
        ("lck-ep", "lck_ep"),
        ("lck-megatron", "lck_megatron"),
    ):
        pkg = tmp_path / "packages" / dist
        (pkg / "src" / imp).mkdir(parents=True)
        shutil.copy(ROOT / "packages" / dist / "pyproject.toml", pkg / "pyproject.toml")
        (pkg / "src" / imp / "__init__.py").write_text("")
    return tmp_path


def test_repository_passes() -> None:
    assert checks.check_layers() == []
    assert checks.check_pins() == []


def test_repository_has_no_import_cycles() -> None:
    assert checks.check_cycles() == []


def test_clean_copy_passes(repo: Path) -> None:
    assert checks.check_layers(repo) == []
    assert checks.check_cycles(repo) == []
    assert checks.check_pins(repo) == []


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = repo / "packages" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("files", "members"),
    [
        (  # two modules importing each other at module level
            {
                "lck-runtime/src/lck_runtime/a.py": "from lck_runtime.b import f\n",
                "lck-runtime/src/lck_runtime/b.py": "import lck_runtime.a\n",
            },
            ["lck_runtime.a", "lck_runtime.b"],
        ),
        (  # a lazy import back, and one only for type checking, still close the circle
            {
                "lck-kernels/src/lck_kernels/x/__init__.py": "",
                "lck-kernels/src/lck_kernels/x/ops.py": "from lck_kernels.x import launch\n",
                "lck-kernels/src/lck_kernels/x/launch.py": "def f():\n    from lck_kernels.x.checks import g\n",
                "lck-kernels/src/lck_kernels/x/checks.py": (
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .ops import Op\n"
                ),
            },
            ["lck_kernels.x.checks", "lck_kernels.x.launch", "lck_kernels.x.ops"],
        ),
    ],
)
def test_import_cycle_detected(repo: Path, files: dict[str, str], members: list[str]) -> None:
    _write(repo, files)
    problems = checks.check_cycles(repo)
    assert len(problems) == 1 and all(m in problems[0] for m in members), problems


def test_package_and_its_submodules_are_no_cycle(repo: Path) -> None:
    """A package ``__init__`` re-exporting its submodules, which import each other one way: no circle."""
    _write(
        repo,
        {
            "lck-kernels/src/lck_kernels/y/__init__.py": "from lck_kernels.y.ops import op\n",
            "lck-kernels/src/lck_kernels/y/ops.py": "from lck_kernels.y.checks import check\n",
            "lck-kernels/src/lck_kernels/y/checks.py": "from lck_kernels import _common\n",
            "lck-kernels/src/lck_kernels/_common.py": "",
        },
    )
    assert checks.check_cycles(repo) == []


@pytest.mark.parametrize(
    ("member", "module", "source", "kind"),
    [
        ("lck-runtime", "lck_runtime", "import lck_kernels\n", "upward"),
        ("lck-kernels", "lck_kernels", "from lck_ep.buffer import Buffer\n", "upward"),
        ("lck-kernels", "lck_kernels", "def f():\n    import lck_megatron\n", "upward"),
        ("lck-ep", "lck_ep", "import lck_megatron.patch\n", "upward"),
        ("lck-megatron", "lck_megatron", "import lck_ep\n", "only lazily"),
        (
            "lck-megatron",
            "lck_megatron",
            "try:\n    import lck_ep\nexcept ImportError:\n    pass\n",
            "only lazily",
        ),
    ],
)
def test_layer_violation_detected(repo: Path, member: str, module: str, source: str, kind: str) -> None:
    (repo / "packages" / member / "src" / module / "bad.py").write_text(source)
    problems = checks.check_layers(repo)
    assert len(problems) == 1 and kind in problems[0] and "bad.py" in problems[0], problems


def test_downward_and_lazy_imports_allowed(repo: Path) -> None:
    (repo / "packages/lck-megatron/src/lck_megatron/ok.py").write_text(
        "import lck_kernels\nimport lck_runtime\n\ndef moe():\n    import lck_ep\n"
    )
    (repo / "packages/lck-ep/src/lck_ep/ok.py").write_text("from lck_kernels import swiglu\n")
    assert checks.check_layers(repo) == []


def test_meta_pin_mismatch_detected(repo: Path) -> None:
    text = (repo / "pyproject.toml").read_text().replace('"lck-ep==0.1.0"', '"lck-ep==0.0.9"')
    (repo / "pyproject.toml").write_text(text)
    problems = checks.check_pins(repo)
    assert any("lck-ep==0.0.9" in p for p in problems), problems


def test_member_version_bump_without_pin_detected(repo: Path) -> None:
    path = repo / "packages/lck-kernels/pyproject.toml"
    path.write_text(path.read_text().replace('version = "0.1.0"', 'version = "0.2.0"', 1))
    problems = checks.check_pins(repo)
    assert any("lck-kernels" in p and "0.2.0" in p for p in problems), problems
    # lck-ep and lck-megatron depend on lck-kernels==0.1.0 too: each is named.
    assert sum("lck-kernels==0.1.0" in p for p in problems) >= 2, problems


def test_missing_meta_pin_detected(repo: Path) -> None:
    text = (repo / "pyproject.toml").read_text().replace('    "lck-megatron==0.1.0",\n', "")
    (repo / "pyproject.toml").write_text(text)
    assert any("does not pin lck-megatron" in p for p in checks.check_pins(repo))
