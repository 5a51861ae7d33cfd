"""pytest fixtures for the fake NVIDIA driver; tests/conftest.py imports them by name.

- fake_nvml_lib: session; fake_nvml_lib(variant="full") -> directory holding that build's
  libnvidia-ml.so.1 ("full"; "no_v2": no v2 memory / v3 process queries, before R510;
  "v1_only": no v2 process queries either, R450 and older). Built once per session with gcc;
  skipped with a reason where gcc is missing.
- fake_nvml: a FakeNvml over the full build and an empty configuration (a driver with no GPUs)
  under tmp_path; .write(text) sets the GPUs; .env() is a whole environment for a child process
  (a real daemon) that should see them, .env({}) just the two variables it needs.
- fake_nvml_inprocess: the same, with this test process's pynvml bound to the fake (preloaded
  once per session; skipped if pynvml already loaded a real driver here) and
  MEMD_FAKE_NVML_CONFIG set for the test; .init_calls() counts nvmlInit attempts.
"""
from __future__ import annotations

import shutil
from typing import Callable, Dict

import pytest

from tests.fakenvml import CONFIG_ENV, FakeNvml, build, preload


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found: cannot build the fake libnvidia-ml.so.1 (tests/fakenvml)")
    root = str(tmp_path_factory.mktemp("fakenvml"))
    built: Dict[str, str] = {}

    def lib_dir(variant: str = "full") -> str:
        if variant not in built:
            built[variant] = build(root, variant)
        return built[variant]

    return lib_dir


@pytest.fixture
def fake_nvml(fake_nvml_lib: Callable[..., str], tmp_path) -> FakeNvml:
    fake = FakeNvml(lib_dir=fake_nvml_lib("full"), config_path=str(tmp_path / "fakenvml.conf"))
    fake.write("")
    return fake


@pytest.fixture(scope="session")
def fake_nvml_preloaded(fake_nvml_lib: Callable[..., str]):
    """The fake loaded into this process (its ctypes handle), before pynvml loads a library."""
    try:
        return preload(fake_nvml_lib("full"))
    except RuntimeError as e:
        pytest.skip(f"cannot put the fake NVML under this process's pynvml: {e}")


@pytest.fixture
def fake_nvml_inprocess(fake_nvml: FakeNvml, fake_nvml_preloaded,
                        monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    monkeypatch.setenv(CONFIG_ENV, fake_nvml.config_path)
    fake_nvml.lib = fake_nvml_preloaded
    return fake_nvml
