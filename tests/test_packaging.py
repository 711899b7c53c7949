"""The built wheel holds every module of every folder mapped into `radixkv.*`."""

import pathlib
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_holds_every_module(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    [wheel] = tmp_path.glob("radixkv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    expected = set()
    for package, folder in package_dir.items():
        for source in (ROOT / folder).glob("*.py"):
            expected.add(package.replace(".", "/") + "/" + source.name)
    assert expected, "no modules found: the package map is wrong"
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert any(n.endswith("entry_points.txt") for n in names), "the radixkv console script is not declared"
