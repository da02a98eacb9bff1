"""An in-process Flower ``Grid``: the real ServerApp and ClientApp code, no SuperLink.

Every message's records are serialized to Flower's wire objects and rebuilt on the other side
(``deflate``/``inflate``, exactly what a SuperLink transfers), each node keeps its own
``Context`` (``node_config``, ``state``) across messages, and a ClientApp exception becomes an
error reply as it does in deployment. Used by the parity tests and the overhead benchmark; a
node can be taken down (``gone``: no replies, e.g. to exercise timeouts).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

FIRST_NODE_ID = 1001


def through_wire(content: RecordDict) -> RecordDict:
    """``content`` serialized to Flower's object contents and inflated back."""
    with no_object_id_recompute():
        objects = get_all_nested_objects(content)
        blobs = {oid: obj.deflate() for oid, obj in objects.items()}
    return cast(RecordDict, inflate_object_from_contents(content.object_id, blobs))  # a copy


def _deliver(msg: Message) -> Message:
    """A copy of ``msg`` as the receiver sees it (its records rebuilt from wire bytes)."""
    if msg.has_error():
        return msg
    # ``metadata=`` is Flower's internal constructor (its overloads leave it out)
    return Message(through_wire(msg.content), metadata=copy.deepcopy(msg.metadata))  # type: ignore[call-overload]


class LocalGrid(Grid):
    """Nodes ``1001..`` with the given node configs, each running ``client_app`` in-process."""

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: Sequence[Mapping[str, Any]],
        run_config: Mapping[str, Any],
        run_id: int = 1,
    ) -> None:
        self.client_app = client_app
        # What the ServerApp runtime sets in its process; Message() reads it.
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        TaskIdentity.task_id = 0
        self.contexts = {
            FIRST_NODE_ID + i: Context(
                run_id, FIRST_NODE_ID + i, dict(cfg), RecordDict(), dict(run_config)
            )
            for i, cfg in enumerate(node_configs)
        }
        self.gone: set[int] = set()  # nodes that are listed but never answer
        self._run = Run.create_empty(run_id)
        self._replies: dict[str, Message] = {}
        self._next_id = 0
        self.client_seconds = 0.0  # time spent inside ClientApp calls

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _new_id(self) -> str:
        self._next_id += 1
        return f"local-{self._next_id}"

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids: list[str] = []
        for msg in messages:
            mid = self._new_id()
            # As Flower's own grids do: the Grid assigns the message id when pushing.
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            node = msg.metadata.dst_node_id
            if node in self.gone or node not in self.contexts:
                continue
            received = _deliver(msg)
            t0 = time.perf_counter()
            try:
                reply = self.client_app(received, self.contexts[node])
            except Exception as exc:  # the ClientApp runtime turns exceptions into error replies
                reply = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"),
                    reply_to=received,
                )
            self.client_seconds += time.perf_counter() - t0
            reply.metadata.__dict__["_message_id"] = self._new_id()
            self._replies[mid] = _deliver(reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(mid) for mid in list(message_ids) if mid in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
