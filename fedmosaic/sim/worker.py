"""Entry point of a simulator worker process: ``python -m fedmosaic.sim.worker <fd>``.

Started by :class:`fedmosaic.sim.processes.ProcessTransport` as a fresh interpreter (not a
multiprocessing child: nothing re-imports the user's ``__main__``, so scripts without an
``if __name__ == "__main__"`` guard, notebooks and pytest all work). ``<fd>`` is this end of a
socket pair; messages on it are pickled tuples of plain values and wire bytes (never datasets or
models). The environment (set by the parent) pins one math thread and tunes glibc malloc before
torch is imported.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from fedmosaic import numerics
from fedmosaic.sim.layout import run_delay
from fedmosaic.sim.processes import recv, send, worker_setup


def _serve(conn: Connection) -> None:
    torch.set_num_threads(int(os.environ.get("FEDMOSAIC_WORKER_THREADS", "1")))
    numerics.apply_in_process()  # the parent's portable pins came with the environment
    host = None
    while True:
        try:
            cmd, args = recv(conn)
        except (EOFError, OSError):  # the parent went away
            return
        if cmd == "stop":
            return
        try:
            if cmd == "init":
                host = None
                _reset_peak_rss()
                host = worker_setup(args)
                reply: tuple[str, Any] = ("ok", os.getpid())
            elif cmd == "reset":
                host = None
                _release_memory()
                reply = ("ok", None)
            else:
                reply = ("ok", _run(host, cmd, args, lambda part: send(conn, ("part", part))))
        except Exception:
            reply = ("error", traceback.format_exc())
        send(conn, reply)


def _release_memory() -> None:
    """Free what the last run held and hand it back to the OS (malloc keeps it otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    """Restart VmHWM so ``rss`` reports this run's peak (Linux; ignored elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _run(host: Any, cmd: str, args: dict[str, Any], emit: Callable[[Any], None]) -> Any:
    """Run one command; per-client results of ``fit`` (and the ids of the clients ``finetune``
    has done) are sent as they are ready (``emit``)."""
    if cmd == "flush":
        host.flush(args["cids"])
        return None
    if cmd == "fit":
        wall, cpu, waited = time.perf_counter(), time.process_time(), run_delay()
        msgs = host.decode_all(args["blobs"])
        flushed = host.keep_only([]) if args["offload"] else []  # last round's clients
        todo = [(cid, msgs[key]) for cid, key in args["clients"]]
        # seconds: the host's cost model; grouped clients (train.batched_clients) share theirs
        for cid, *out in host.fit_many(args["round"], todo):
            emit((cid, *out))
            if args["offload"]:  # memory per worker: one client's model, whatever the round size
                host.flush([cid])
        flushed += [c for c, _ in args["clients"]] if args["offload"] else []
        # this worker's share of its core over the fit (the layout chooser's contention signal):
        # 1 - the time it was runnable but kept off a CPU by other tasks (the kernel's run delay;
        # waiting on messages or the disk is not contention), else CPU time over wall time
        wall = max(time.perf_counter() - wall, 1e-9)
        after = run_delay()
        if waited is not None and after is not None:
            share = 1.0 - (after - waited) / wall
        else:
            share = (time.process_time() - cpu) / wall
        return flushed, share
    if cmd == "eval":
        msgs = host.decode_all(args["blobs"])
        return [
            (cid, host.evaluate(cid, msgs[key], args["receive"])) for cid, key in args["clients"]
        ]
    if cmd == "finetune":
        msgs = host.decode_all(args["blobs"])
        for cid, key in args["clients"]:
            host.finetune(cid, msgs[key], args["phases"])
            if args["offload"]:
                host.flush([cid])
            emit(cid)  # progress: the parent counts the clients done
        return None
    if cmd == "states":
        return host.state_dicts(args["cids"])
    if cmd == "set_states":
        for cid, (model_state, extras_state) in args["states"].items():
            model, extras = host.take(cid)
            model.load_state_dict(model_state, strict=True)
            extras.load_state_dict(extras_state, strict=True)
            if args["offload"]:
                host.flush([cid])
        return None
    if cmd == "rss":
        return _peak_rss_bytes()
    raise ValueError(f"unknown worker command {cmd!r}")


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _die_with_parent() -> None:
    """On Linux, be killed when the process that started us dies (a killed run leaves no
    worker computing on); elsewhere the closed socket ends us at the next message."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.environ.get("FEDMOSAIC_PARENT_PID")
    if parent is not None and os.getppid() != int(parent):  # died before prctl took effect
        sys.exit(0)


def main() -> None:
    _die_with_parent()
    conn = Connection(int(sys.argv[1]))
    try:
        _serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
