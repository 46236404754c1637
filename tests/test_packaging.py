"""The wheel carries kernels/ and models.toml, and works from a fresh virtual environment outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], check=True)
    (whl,) = out.glob("llamacli-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    cu = [n for n in names if n.startswith("llamacli/kernels/") and n.endswith(".cu")]
    on_disk = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert on_disk and sorted(Path(n).name for n in cu) == on_disk
    assert "llamacli/models.toml" in names
    assert not any(n.startswith("tests/") for n in names)
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    # The script enters through the package's small __init__, which guards the CLI's imports against Ctrl-C.
    assert "llamacli = llamacli:run" in zipfile.ZipFile(wheel).read(ep).decode()


def test_installed_wheel_runs_outside_the_checkout(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # The running interpreter's packages provide the dependencies (a path line in a .pth file: the base
    # interpreter's site-packages need not hold them when the tests run in a virtual environment, as CI's do,
    # and the editable install's finder there is not activated); llamacli itself comes from the wheel, and we
    # run from a folder outside the checkout so that nothing of the source tree can be picked up.
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    py = env_dir / "bin" / "python"
    inner = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                           text=True, check=True).stdout.strip()
    outer = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (Path(inner) / "_outer_deps.pth").write_text("".join(f"{d}\n" for d in sorted(outer)))
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, cwd=tmp_path)
    r = subprocess.run([env_dir / "bin" / "llamacli", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "inspect" in r.stdout and "generate" in r.stdout
    code = "from llamacli.paths import kernels_dir, builtin_models_toml; import llamacli; print(llamacli.__file__); print(kernels_dir()); print(builtin_models_toml())"
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    module, kernels, toml = (Path(line) for line in r.stdout.split())
    assert env_dir in module.parents, module
    assert env_dir in kernels.parents and sorted(p.name for p in kernels.glob("*.cu")) == sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert env_dir in toml.parents and toml.read_text().strip()
