"""Run a reference's ``main.py`` (cwd = its ``system/``) unchanged, with stand-ins only for imports
of optional packages that the run never uses.

HtFLlib's ``main.py`` imports every server, FedKTL's included (StyleGAN / Stable Diffusion
packages), and ``models.py`` imports ``torchvision`` for model groups we do not run. Where such an
import fails, an empty stand-in module is registered that raises if anything in it is *used*, so a
run that needed it fails loudly instead of silently changing. Usage (the reference's venv)::

    cd <ref>/system && <ref-venv>/bin/python <this file> -data ... -algo FedProto ...
"""

from __future__ import annotations

import importlib
import runpy
import sys
import types
from typing import Any

OPTIONAL = [
    "torchvision",
    "flcore.servers.serverktl_stylegan_xl",
    "flcore.servers.serverktl_stylegan_3",
    "flcore.servers.serverktl_stable_diffusion",
]


class _Missing(types.ModuleType):
    """A module that could not be imported: any attribute use raises."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def _fail(*_: Any, **__: Any) -> None:
            raise ImportError(f"{self.__name__} is not installed (parity launch shim stand-in)")

        return _fail


def install_stand_ins() -> list[str]:
    """Register stand-ins for the optional imports that fail here; returns their names."""
    sys.path.insert(0, ".")
    missing = []
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except Exception:  # any failure of an optional import: the run does not use it
            sys.modules[name] = _Missing(name)
            missing.append(name)
    return missing


if __name__ == "__main__":
    stood_in = install_stand_ins()
    print(f"parity launch shim: stand-ins for {stood_in or 'nothing'}", flush=True)
    sys.argv = ["main.py", *sys.argv[1:]]
    runpy.run_path("main.py", run_name="__main__")
