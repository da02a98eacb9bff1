"""A SuperNode whose ClientApp process lives as long as the SuperNode.

    python -m fedmosaic.flower.node [--poll-interval S] FLOWER_SUPERNODE_ARGS...

Flower 1.41's SuperNode (``--isolation subprocess``, its default) starts a SuperExec that starts
a new ``flwr-clientapp`` process for every message: Python start, ``import torch``, installing the
app bundle and rebuilding the client cost seconds per message, and ``flwr-clientapp`` exits after
one message by design. Its message loop also sleeps 3 s whenever the SuperLink has nothing for it
and 0.5 s between looks for the ClientApp's reply (``flwr.supernode.start_client_internal``: fixed
numbers, no flag or variable sets them).

This command runs ``flower-supernode`` with the same arguments in ``--isolation process`` and
starts, beside it, one long-running worker (``--clientapp-worker``) that takes the SuperNode's
ClientApp tasks one after another over its Runtime API, as ``flwr-clientapp`` would, but in one
process: torch is imported once, the data split and the client are built once per run
(``fedmosaic.flower.app``), and every message still starts from and returns the client's state
in ``context.state``, so the numbers are the simulator's. It serves fedmosaic's app only (the
component ``fedmosaic.flower.app:client_app``, imported from the installed package: nothing is
installed under ``FLWR_HOME``); any other app's tasks get an error reply. The SuperNode's two
sleeps, and its and the worker's waits for message objects still in transit (1 s, then
doubling), are capped at ``--poll-interval`` (a patch of that one Flower module, in this
process only). The worker exits when the SuperNode does.
"""

from __future__ import annotations

import argparse
import functools
import io
import logging
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import httpx  # a Flower dependency

from fedmosaic.flower.app import FLWR_PATCHED, client_app  # Flower's API only: no torch yet

log = logging.getLogger("fedmosaic.flower.node")

POLL_INTERVAL = 0.1  # seconds: SuperNode <-> SuperLink and worker <-> SuperNode polling
CLIENT_APP = "fedmosaic.flower.app:client_app"


class ForeignAppError(RuntimeError):
    """A run whose ClientApp is not fedmosaic's: this worker does not load app bundles."""


# ---- the worker: one process, many ClientApp tasks ------------------------------------------------
def clientapp_component(fab: Any, seen: dict[str, str]) -> str:
    """The ``clientapp`` component named in the app bundle's ``pyproject.toml``."""
    if fab.hash_str not in seen:
        from fedmosaic.config import tomllib  # tomli on Python 3.10

        with zipfile.ZipFile(io.BytesIO(fab.content)) as bundle:
            project = tomllib.loads(bundle.read("pyproject.toml").decode())
        components = project.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {})
        seen[fab.hash_str] = str(components.get("clientapp", ""))
    return seen[fab.hash_str]


def _task_heartbeat(client: Any) -> Callable[[], bool]:
    """Flower's task heartbeat without its reaction to an unknown task (SIGINT to the process):
    here the process outlives its tasks, and a heartbeat racing a finished task is harmless."""
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as err:
            if err.response.status_code in (503, 504):
                return False
            raise
        return True

    return beat


def pull_task_input(client: Any, backoff: float) -> tuple[Any, Any, Any, Any]:
    """``flwr.supernode.runtime.run_clientapp.pull_task_input`` with ``backoff`` (not 1 s, then
    doubling) between looks for message objects the SuperNode is still fetching: a worker that
    is already running takes a task the moment it exists, before its objects have arrived."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
        PullAppMessagesRequest,
        PullTaskInputRequest,
    )
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run, fab = run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
        return_type=Message,
        max_tries_per_object=None,  # bounded by Flower's max_time (2 h) instead
        initial_backoff=backoff,
        backoff_cap=backoff,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower's: not in the tree
    return message, context, run, fab


def run_task(
    address: str,
    token: str,
    root_certificates: bytes | None,
    seen: dict[str, str],
    poll_interval: float = POLL_INTERVAL,
) -> bool:
    """One ClientApp task, as ``flwr-clientapp`` runs it (pull the message and context, run the
    app, push the reply, then the context and the status). True when the app replied."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    client = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        ],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    heartbeat = HeartbeatSender(_task_heartbeat(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    marks = [("start", time.perf_counter())]  # where a message's time went
    try:
        message, context, run, fab = pull_task_input(client, poll_interval)
        marks.append(("pull", time.perf_counter()))
        component = clientapp_component(fab, seen)
        if component != CLIENT_APP:
            raise ForeignAppError(
                f"run {run.run_id} ({run.fab_id}) has clientapp {component!r}; this SuperNode "
                f"(python -m fedmosaic.flower.node) serves {CLIENT_APP!r} only"
            )
        reply = client_app(message=message, context=context)
        marks.append(("app", time.perf_counter()))
        status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # the reply says what went wrong, as flwr-clientapp's does
        log.exception("ClientApp task failed")
        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        if isinstance(ex, ForeignAppError):
            code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
        details = f"{type(ex)}:<'{ex}'>"
        if message is not None:
            reply = Message(Error(code=code, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception:  # noqa: BLE001 - the SuperNode times the task out; keep serving
            log.exception("failed to push the reply")
            status = SubStatus.FAILED
        push_task_output(client, context, status, details)
        if heartbeat.is_running:  # its thread ends on an error of its own: the worker goes on
            heartbeat.stop()
        client.close()
        marks.append(("push", time.perf_counter()))
        log.info(
            "%s message %s: %s",
            "?" if message is None else message.metadata.message_type,
            status,
            ", ".join(f"{k} {b - a:.3f}s" for (_, a), (k, b) in zip(marks, marks[1:])),
        )
    return status == SubStatus.COMPLETED


def serve_clientapps(
    address: str,
    root_certificates: bytes | None = None,
    poll_interval: float = POLL_INTERVAL,
) -> None:
    """Take the SuperNode's ClientApp tasks at ``address`` (its Runtime API) one after another,
    until the process is stopped."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    # torch and the client code imported before the first task, not during it
    import fedmosaic.core.client  # noqa: F401
    import fedmosaic.flower.codec  # noqa: F401
    import fedmosaic.flower.messages  # noqa: F401

    executor = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    seen: dict[str, str] = {}  # app bundle hash -> its clientapp component
    try:
        while True:
            res = executor.AcquireTask(request)
            if res.HasField("task") and res.token:
                run_task(address, res.token, root_certificates, seen, poll_interval)
            else:
                time.sleep(poll_interval)
    finally:
        executor.close()


# ---- the SuperNode ------------------------------------------------------------------------------
def cap_supernode_sleeps(poll_interval: float) -> None:
    """Cap the sleeps of Flower's SuperNode message loop (3 s idle, 0.5 s waiting for a reply)
    at ``poll_interval``: that module's ``time`` only; nothing else in the process changes."""
    import flwr.supernode.start_client_internal as loop
    from flwr.supercore.version import package_version

    if package_version != FLWR_PATCHED:
        log.warning(
            "flwr %s: the SuperNode waits capped here are %s's", package_version, FLWR_PATCHED
        )
    real = loop.time

    class _CappedClock:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            real.sleep(min(seconds, poll_interval))

    loop.time = _CappedClock()  # type: ignore[assignment]
    # The SuperNode fetches a message's objects from the SuperLink while the ServerApp may still
    # be uploading them; Flower waits 1 s (then doubling) before looking again.
    loop.pull_objects = functools.partial(
        loop.pull_objects,
        max_tries_per_object=None,  # bounded by Flower's max_time (2 h) instead
        initial_backoff=poll_interval,
        backoff_cap=poll_interval,
    )


def _runtime_address(args: argparse.Namespace) -> str:
    from flwr.supercore.constant import SUPERNODE_UVICORN_DEFAULT_PORT, UVICORN_DEFAULT_HOST

    host = args.host or UVICORN_DEFAULT_HOST
    if host in ("0.0.0.0", "::", "[::]"):  # bound everywhere: reach it on loopback
        host = "127.0.0.1"
    return f"{host}:{args.port or SUPERNODE_UVICORN_DEFAULT_PORT}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedmosaic.flower.node",
        allow_abbrev=False,
        description="flower-supernode with one long-running fedmosaic ClientApp process; "
        "every other argument goes to flower-supernode",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=POLL_INTERVAL,
        help=f"seconds between polls of the SuperLink and of the SuperNode (default "
        f"{POLL_INTERVAL}; Flower's own: 3 s idle, 0.5 s for replies)",
    )
    p.add_argument("--clientapp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--runtime-api-address", help=argparse.SUPPRESS)
    p.add_argument("--runtime-root-certificates", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    return p


def _supernode_view() -> argparse.ArgumentParser:
    """The flower-supernode options this launcher needs to read (left in place for it)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--ssl-ca-certfile")
    p.add_argument("--isolation")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args, rest = _parser().parse_known_args(argv)
    if not 0.01 <= args.poll_interval <= 10:
        raise SystemExit(f"--poll-interval {args.poll_interval}: must be in [0.01, 10] seconds")
    # fedmosaic's records only: a root handler would also print Flower's DEBUG records and
    # httpx's line per request (ten a second per poller)
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    )
    logging.getLogger("fedmosaic").addHandler(handler)
    logging.getLogger("fedmosaic").setLevel(logging.INFO)
    if args.clientapp_worker:
        from flwr.supercore.app_utils import start_parent_process_monitor

        if args.parent_pid is not None:  # the SuperNode gone (even SIGKILLed): stop too
            start_parent_process_monitor(args.parent_pid)
        certs = None
        if args.runtime_root_certificates:
            with open(args.runtime_root_certificates, "rb") as fh:
                certs = fh.read()
        serve_clientapps(args.runtime_api_address, certs, args.poll_interval)
        return
    node, _ = _supernode_view().parse_known_args(rest)
    if node.isolation not in (None, "process"):
        raise SystemExit("--isolation: this SuperNode runs its ClientApp in its own process")
    worker = [
        sys.executable, "-m", "fedmosaic.flower.node", "--clientapp-worker",
        "--runtime-api-address", _runtime_address(node),
        "--parent-pid", str(os.getpid()),
        "--poll-interval", str(args.poll_interval),
    ]  # fmt: skip
    if node.ssl_ca_certfile:  # the Runtime API serves TLS: the worker verifies it
        worker += ["--runtime-root-certificates", node.ssl_ca_certfile]
    subprocess.Popen(worker)  # noqa: S603 - our own module, our own interpreter
    cap_supernode_sleeps(args.poll_interval)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *rest, *([] if node.isolation else ["--isolation", "process"])]
    flower_supernode()


if __name__ == "__main__":
    main()
