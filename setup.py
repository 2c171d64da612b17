"""The build step pyproject.toml can't declare: the wheel carries cases/ and golden/ as package data.

The folders stay at the repo root (one committed copy); build_py copies them into
harness/_data/ of the build, where harness/cases/data.py finds them in an installed wheel.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE_DATA = {"cases": ("*.toml",), "golden": ("*.json", "*.npz", "acceptance/*.json")}


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        for kind, patterns in PACKAGE_DATA.items():
            for pattern in patterns:
                for src in sorted((ROOT / kind).glob(pattern)):
                    dst = Path(self.build_lib, "harness", "_data", kind, src.relative_to(ROOT / kind))
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)


setup(cmdclass={"build_py": BuildPyWithData})
