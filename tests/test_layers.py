"""The import contract of pyproject.toml ([tool.importlinter]): jaxpar's layers import only
downward and no package's modules import each other in a circle; a test makes each kind of fault
in a copy of the package and sees the contract break."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    """lint-imports on the package under ``root`` with the project's contract."""
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run(LINT + ["--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_layers_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("models/llama.py", "import jaxpar.train.step  # noqa: F401", "jaxpar.models is not allowed to import jaxpar.train"),
    ("train/state.py", "import jaxpar.train.step  # noqa: F401", "no import circle among the modules of any package BROKEN"),
])
def test_an_upward_import_or_a_circle_breaks_them(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "jaxpar", tmp_path / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "jaxpar" / module
    path.write_text(path.read_text() + "\n" + line + "\n")
    result = lint(tmp_path)
    assert result.returncode != 0 and broken in result.stdout, result.stdout[-3000:]
