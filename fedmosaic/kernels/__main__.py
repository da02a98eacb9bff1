"""``python -m fedmosaic.kernels build``: compile the native kernels (run by scripts/setup.sh)."""

from __future__ import annotations

import sys

from fedmosaic import kernels


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "build":
        why = kernels.compiler()
        if why or not kernels.cpu_supported():
            print(f"fedmosaic.kernels: not built ({why or 'CPU lacks AVX2/FMA'}); torch path")
            return 0
        done = kernels.built()
        print(f"fedmosaic.kernels: {'up to date' if done else 'built'} {done or kernels.build()}")
        return 0
    if cmd == "status":
        print(f"fedmosaic.kernels: {kernels.status()}")
        return 0
    print("usage: python -m fedmosaic.kernels [build|status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
