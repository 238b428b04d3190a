"""A built wheel works on its own: installed into a fresh virtual environment, `jaxpar train` runs
from a directory outside the repository (the topology files travel as package data)."""
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_trains_from_any_directory(tmp_path):
    # built from a copy: setuptools writes its build/ folder next to the sources
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache"))
    wheels = tmp_path / "wheels"
    # no build isolation: the test extra brings a setuptools that builds wheels (no download here)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source)],
                   check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("jaxpar-*.whl")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    # this environment's pip installs into the new one (no pip of its own to bootstrap there)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True)
    # jaxpar's dependencies come from this environment's site-packages (a .pth line adds the
    # directory only: this environment's editable jaxpar is not on the new one's path)
    new_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    pathlib.Path(new_site, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAXPAR_MESHES")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(
        [env_dir / "bin" / "jaxpar", "train", "--steps", "2", "--batch-size", "8", "--seq-len", "16",
         "--strategy", "data=2,fsdp=4", "--metrics-json", "out/metrics.json"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    located = subprocess.run([python, "-c", "import jaxpar; print(jaxpar.__file__)"], cwd=work, env=env,
                             check=True, capture_output=True, text=True).stdout
    assert str(env_dir) in located  # the installed wheel ran, not the checkout
    saved = json.loads((work / "out" / "metrics.json").read_text())
    assert len(saved["losses"]) == 2 and saved["strategy"] == "data=2,fsdp=4"
    assert [p.name for p in (work / "out").iterdir()] == ["metrics.json"]  # no temporary left behind
    assert "collectives per step" in out.stdout
