"""Shared fixtures."""
from tests.fakenvml.fixtures import (  # noqa: F401  (fixtures: see tests/fakenvml/fixtures.py)
    fake_nvml, fake_nvml_inprocess, fake_nvml_lib, fake_nvml_preloaded)
