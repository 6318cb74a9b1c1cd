"""The installed layout: the repository's services/ directory is the package ``rlfabric.services`` (one installed
namespace: no top-level ``services`` to collide with another package's). pyproject.toml holds everything else;
setuptools cannot give a found package another name from pyproject.toml alone."""

from setuptools import find_packages, setup

setup(
    packages=["rlfabric", *(f"rlfabric.{p}" for p in find_packages(include=["services", "services.*"]))],
    package_dir={"rlfabric.services": "services"},
)
