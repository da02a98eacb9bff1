"""``python -m fedmosaic.kernels build``: compile the native kernels (run by scripts/setup.sh).

A build prints a line when the compiler starts (where, about how long) and one when it ends (its
time); ``FEDMOSAIC_KERNELS=0`` skips it, as it skips the kernels in a run.
"""

from __future__ import annotations

import os
import sys

from fedmosaic import kernels


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "build":
        why = kernels.compiler()
        if os.environ.get(kernels.ENV, "1") == "0":
            why = f"{kernels.ENV}=0"
        if why or not kernels.cpu_supported():
            print(f"fedmosaic.kernels: not built ({why or 'CPU lacks AVX2/FMA'}); torch path")
            return 0
        done = kernels.built()
        if done:
            print(f"fedmosaic.kernels: up to date {done}")
            return 0
        try:
            so = kernels.build()
        except Exception as e:  # noqa: BLE001 - the compiler's output, then a failing status
            print(f"fedmosaic.kernels: not built: {e}", file=sys.stderr)
            return 1
        print(f"fedmosaic.kernels: built {so}")
        return 0
    if cmd == "status":
        print(f"fedmosaic.kernels: {kernels.status()}")
        return 0
    print("usage: python -m fedmosaic.kernels [build|status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
