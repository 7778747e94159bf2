"""Packaging glue that pyproject.toml cannot say: ship the top-level ``conf/`` inside the package.

The Hydra configs live at the top of the repository, where users read and edit them, and install
as ``parallel_lab/conf/`` (a package-dir mapping), so a wheel carries them and
``parallel_lab.config.compose.CONF_DIR`` finds them in either place. Everything else about the
project is in pyproject.toml, except the package's own data files (package_data below).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["parallel_lab", "parallel_lab.*"]), "parallel_lab.conf"],
    package_dir={"parallel_lab.conf": "conf"},
    # bench/published_runs.csv: the published runs `bench published` checks the planner against
    package_data={"parallel_lab.conf": ["*.yaml", "*/*.yaml"], "parallel_lab.bench": ["*.csv"]},
)
