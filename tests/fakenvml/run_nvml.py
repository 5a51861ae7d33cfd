"""Run memd's Nvml in a fresh process against whatever libnvidia-ml.so.1 it finds; print JSON.

    python -m tests.fakenvml.run_nvml [--hide-nvml] STEPS_JSON

STEPS_JSON is a list of steps run in order, each one of
    {"config": TEXT}         rewrite the file named by MEMD_FAKE_NVML_CONFIG (atomically)
    {"clock": SECONDS}       set the clock Nvml reads for its re-initialisation back-off
    {"sample": HOST_TOTAL}   Nvml.sample(HOST_TOTAL) -> {"gpus": [...], "errors": [[src, msg]]}
    {"status": null}         Nvml.status() -> its fields
Only sample and status steps print, as one JSON list on stdout; logs go to stderr.
--hide-nvml makes the bindings fail to load the library, as on a machine without a driver.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import structlog

from tests.fakenvml import CONFIG_ENV, write_config


def main(argv: list) -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if argv[0] == "--hide-nvml":
        import pynvml

        def no_library(name, *args, **kwargs):
            raise OSError(f"{name}: cannot open shared object file (hidden by run_nvml)")

        pynvml.CDLL = no_library  # pynvml calls CDLL("libnvidia-ml.so.1") by this global name
        argv = argv[1:]
    from memd.sampling.nvml import Nvml

    now = [0.0]
    nvml = Nvml(clock=lambda: now[0])
    out = []
    for step in json.loads(argv[0]):
        if "config" in step:
            write_config(os.environ[CONFIG_ENV], step["config"])
        elif "clock" in step:
            now[0] = float(step["clock"])
        elif "sample" in step:
            gpus, errors = nvml.sample(step["sample"])
            out.append({"gpus": [dataclasses.asdict(g) for g in gpus], "errors": errors})
        elif "status" in step:
            out.append(dataclasses.asdict(nvml.status()))
    nvml.shutdown()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
