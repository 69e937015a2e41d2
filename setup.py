"""Which packages the wheel holds, found rather than listed, so a new subpackage can never be left out.

``smpckpt/`` is the package; ``planners/`` and ``storage/`` sit beside it in the repository but install
as ``smpckpt.planners`` and ``smpckpt.storage`` (``package_dir``). Every package inside each of the three
folders (a folder with an ``__init__.py``) is found here; ``tests/test_wheel.py`` builds a wheel from the
tree and fails if any module of the three folders is missing from it or does not import once installed.
Everything else about the project is in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

#: import name -> folder in the repository
PACKAGE_DIR = {"smpckpt": "smpckpt", "smpckpt.planners": "planners", "smpckpt.storage": "storage"}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIR.items():
        found.append(name)
        found.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return sorted(found)


setup(packages=packages(), package_dir=PACKAGE_DIR)
