"""A :class:`~fedmosaic.core.rounds.Transport` over a Flower ``Grid``.

One message per (client, round) to the SuperNode that serves that client's partition; the node
map comes from a ``query`` handshake (each SuperNode answers with its ``partition-id`` node
config). A declared partition is only a claim: with the ``node-partitions`` allow-list a node
serves only the partition listed for its (authenticated) node id; without it the first claimant
keeps the partition and later ones are refused with a log line (never silently preferred).
A reply whose source node is not the node its message went to is dropped with a log line.
Replies are decoded and validated here (header, the records expected and no others, payload
type, byte cap over every record, array kinds, dtypes and shapes as declared, finite values, the
client's known example count); a reply that fails, arrives late, or never arrives becomes a
:class:`FitResult` with ``error`` set, which the round loop drops with a log line naming the
client. Nothing here raises on a bad reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from flwr.app import Message, RecordDict

from fedmosaic.core import membership, secure
from fedmosaic.core.algorithm import Algorithm, Phase
from fedmosaic.core.client import ClientData
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.rounds import (
    ClientProgress,
    ClientState,
    ClientStatesUnavailable,
    EvalResult,
    FitResult,
)
from fedmosaic.flower import messages as m
from fedmosaic.flower import secagg
from fedmosaic.flower.codec import records_to_payload, wire_size
from fedmosaic.flower.settings import FlowerOptions

log = logging.getLogger("fedmosaic.flower")
K = TypeVar("K")
TTL_MARGIN = 10.0  # seconds a message outlives the wait for its reply
_ON_NODES = "Flower clients keep their state on their SuperNodes; the server cannot read or set it"


def content_bytes(content: RecordDict) -> int:
    """Bytes of every record of a message: array data plus config and metric records (cheap:
    nothing is serialized). Every kind counts, so no record can smuggle data past the cap."""
    total = sum(len(a.data) for rec in content.array_records.values() for a in rec.values())
    total += sum(rec.count_bytes() for rec in content.config_records.values())
    return total + sum(rec.count_bytes() for rec in content.metric_records.values())


def _reason(reply: Message) -> str:
    reason = (reply.error.reason or "").strip().splitlines()
    return f"client error (code {reply.error.code}): {reason[-1][:300] if reason else 'no reason'}"


class GridTransport:
    """Round-loop transport whose clients are Flower SuperNodes (``partition-id`` = client id)."""

    def __init__(
        self,
        grid: Any,
        algo: Algorithm,
        clients: Sequence[ClientData],
        eval_splits: tuple[str, ...],
        options: FlowerOptions,
    ) -> None:
        self.grid = grid
        self.algo = algo
        self.clients = list(clients)
        self.num_clients = len(self.clients)
        self.eval_splits = eval_splits
        self.options = options
        self.node_of: dict[int, int] = {}  # client id -> SuperNode id
        self.ignored: set[int] = set()  # nodes whose handshake was invalid
        self.refused: dict[int, str] = {}  # node -> why it serves no partition (results.json)
        self._hello: dict[str, tuple[int, float]] = {}  # message id -> (node, sent at)
        self.rounds: dict[int, dict[str, Any]] = {}  # per-round transport facts for results.json
        self._on_client: ClientProgress | None = None  # see set_progress
        self._on_finetune: ClientProgress | None = None

    # ---- node discovery -----------------------------------------------------------------------
    def connect(self) -> None:
        """Wait until ``min-nodes`` SuperNodes (default: one per client) answered the handshake."""
        want = min(self.options.min_nodes or self.num_clients, self.num_clients)
        allowed = self.options.node_partitions
        if allowed:
            outside = sorted(p for p in allowed.values() if p >= self.num_clients)
            if outside:
                raise ConfigError(
                    f"run config node-partitions names partitions {outside}, but this federation "
                    f"has {self.num_clients} clients"
                )
            want = min(want, len(allowed))  # unlisted partitions never get a node
        else:
            log.warning(
                "partitions are bound to whichever SuperNode declares them first (no "
                "node-partitions allow-list in the run config): a node claiming another's "
                "partition before it connects would serve it"
            )
        deadline = time.monotonic() + self.options.connect_timeout
        while len(self.node_of) < want and time.monotonic() < deadline:
            self.discover(wait=1.0)
            if len(self.node_of) < want and not self._hello:
                time.sleep(1.0)  # nobody new to ask yet: do not hammer the SuperLink
        if not self.node_of:
            raise RuntimeError(
                f"no SuperNode serving a partition of this federation answered within "
                f"{self.options.connect_timeout:.0f}s (connect-timeout)"
            )
        if len(self.node_of) < want:
            log.warning(
                "starting with %d of %d wanted SuperNodes; clients %s have no node yet",
                len(self.node_of),
                want,
                [c for c in range(self.num_clients) if c not in self.node_of],
            )
        log.info("client -> SuperNode: %s", dict(sorted(self.node_of.items())))

    def discover(self, wait: float = 0.0) -> None:
        """Handshake with SuperNodes not seen before; never blocks longer than ``wait``."""
        try:
            online = {int(n) for n in self.grid.get_node_ids()}
        except Exception as exc:  # a transient Runtime API error must not end the run
            log.warning("could not list SuperNodes: %s", exc)
            return
        now = time.monotonic()
        ttl = max(self.options.eval_timeout, 1.0) + TTL_MARGIN
        self._hello = {k: v for k, v in self._hello.items() if now - v[1] < ttl}
        asked = {node for node, _ in self._hello.values()}
        known = set(self.node_of.values()) | self.ignored | asked
        new = sorted(online - known)
        node: int | None  # None: a reply to no handshake of ours
        if new:
            msgs = [Message(m.with_header(RecordDict()), n, m.HELLO, ttl=ttl) for n in new]
            for node, mid in zip(new, self._push(msgs), strict=True):
                if mid:
                    self._hello[mid] = (node, now)
        deadline = now + wait
        while self._hello:
            for reply in self._pull(list(self._hello)):
                node, _ = self._hello.pop(reply.metadata.reply_to_message_id, (None, 0.0))
                if node is not None and not self._from_elsewhere(reply, node):
                    self._register(node, reply, online)
            if not self._hello or time.monotonic() >= deadline:
                break
            time.sleep(self.options.poll_interval)

    def _refuse(self, node: int, reason: str) -> None:
        log.warning("ignoring SuperNode %d: %s", node, reason)
        self.ignored.add(node)
        self.refused[node] = reason

    def _register(self, node: int, reply: Message, online: set[int]) -> None:
        try:
            if reply.has_error():
                raise PayloadError(_reason(reply))
            m.check_reply_records(reply.content, m.HELLO)
            head = m.header(reply.content)
            pid, total = m.int_field(head, "partition-id"), m.int_field(head, "num-partitions")
            if total != self.num_clients or not 0 <= pid < total:
                raise PayloadError(
                    f"partition-id={pid} num-partitions={total}, but this federation has "
                    f"{self.num_clients} clients"
                )
        except PayloadError as exc:
            self._refuse(node, str(exc))
            return
        allowed = self.options.node_partitions
        if allowed and allowed.get(node) != pid:
            # Authentication proves which node talks; only this list says which partition it owns.
            self._refuse(
                node,
                f"claims partition {pid}, but node-partitions "
                + (f"binds it to partition {allowed[node]}" if node in allowed else "omits it"),
            )
            return
        old = self.node_of.get(pid)
        if old is not None and old != node and old in online:
            # A second claimant is never preferred over the node already serving the partition.
            self._refuse(node, f"partition {pid} is already served by node {old}")
            return
        if old is not None and old != node:
            log.warning("partition %d moved from SuperNode %d to %d", pid, old, node)
        self.node_of[pid] = node

    def _from_elsewhere(self, reply: Message, node: int) -> bool:
        """True (and a log line) when ``reply`` comes from another node than ``node``, the one
        the message went to: its content is not that node's answer, whatever it says."""
        src = reply.metadata.src_node_id
        if src == node:
            return False
        log.warning(
            "dropped a reply from SuperNode %s to a message sent to SuperNode %d", src, node
        )
        return True

    # ---- message exchange ---------------------------------------------------------------------
    def _push(self, msgs: Sequence[Message]) -> list[str | None]:
        if not msgs:
            return []
        try:
            ids = list(self.grid.push_messages(msgs))
        except Exception as exc:
            log.warning("pushing %d messages failed: %s", len(msgs), exc)
            return [None] * len(msgs)
        return ids if len(ids) == len(msgs) else [None] * len(msgs)

    def _pull(self, ids: list[str]) -> Iterable[Message]:
        try:
            return list(self.grid.pull_messages(ids))
        except Exception as exc:
            log.warning("pulling replies failed (will retry until the deadline): %s", exc)
            return []

    def _exchange(
        self, msgs: Mapping[K, Message], timeout: float
    ) -> tuple[dict[K, Message], dict[K, str]]:
        """Push all, then pull until every reply is in or ``timeout`` seconds have passed."""
        keys = list(msgs)
        replies: dict[K, Message] = {}
        failures: dict[K, str] = {}
        pending: dict[str, K] = {}
        key: K | None  # None: a reply to no message of ours
        for key, mid in zip(keys, self._push([msgs[k] for k in keys]), strict=True):
            if mid:
                pending[mid] = key
            else:
                failures[key] = "the SuperLink did not accept the message"
        deadline = time.monotonic() + timeout
        while pending:
            for reply in self._pull(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is None:
                    continue
                dst = msgs[key].metadata.dst_node_id
                if self._from_elsewhere(reply, dst):
                    src = reply.metadata.src_node_id
                    failures[key] = f"reply came from SuperNode {src}, not {dst}: dropped"
                else:
                    replies[key] = reply
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.options.poll_interval)
        for key in pending.values():
            failures[key] = f"no reply within {timeout:g}s"
        return replies, failures

    def _send(
        self, kind: str, round_num: int, contents: Mapping[int, RecordDict], timeout: float
    ) -> tuple[dict[int, Message], dict[int, str], dict[int, int]]:
        """Send one message per client; returns replies, failures and bytes sent per client."""
        self.discover()
        ttl = max(timeout, 1.0) + TTL_MARGIN
        msgs: dict[int, Message] = {}
        failures: dict[int, str] = {}
        down: dict[int, int] = {}
        for cid, content in contents.items():
            node = self.node_of.get(cid)
            if node is None:
                failures[cid] = "no SuperNode serves this partition"
                continue
            down[cid] = wire_size(content)
            msgs[cid] = Message(content, node, kind, ttl=ttl, group_id=str(round_num))
        replies, lost = self._exchange(msgs, timeout)
        failures.update({cid: f"SuperNode {self.node_of[cid]}: {r}" for cid, r in lost.items()})
        for cid, reply in list(replies.items()):
            if reply.has_error():
                failures[cid] = f"SuperNode {self.node_of[cid]}: {_reason(reply)}"
                del replies[cid]
        return replies, failures, down

    def _note(self, round_num: int, key: str, value: Any) -> None:
        self.rounds.setdefault(round_num, {"round": round_num})[key] = value

    def _check_reply(self, cid: int, reply: Message, kind: str) -> dict[str, Any]:
        size = content_bytes(reply.content)
        if size > self.options.max_reply_bytes:
            raise PayloadError(f"{size} bytes exceeds the cap of {self.options.max_reply_bytes}")
        m.check_reply_records(reply.content, kind)
        head = m.header(reply.content)
        claimed = m.int_field(head, "client-id")
        if claimed != cid:
            raise PayloadError(f"reply claims to come from client {claimed}")
        return head

    # ---- Transport ----------------------------------------------------------------------------
    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[FitResult]:
        contents = {
            cid: m.payload_message(msg, **{"client-id": cid, "round": round_num})
            for cid, msg in messages.items()
        }
        t0 = time.perf_counter()
        if self._on_client is not None:
            self._on_client(0, len(messages))
        replies, failures, down = self._send(m.FIT, round_num, contents, self.options.round_timeout)
        if self._on_client is not None:  # the replies are pulled together: all done at once
            self._on_client(len(messages), len(messages))
        self._note(round_num, "fit_seconds", time.perf_counter() - t0)
        results: dict[int, FitResult] = {}
        for cid, reply in replies.items():
            results[cid] = self._fit_result(cid, reply, down[cid])
        for cid, reason in failures.items():
            results[cid] = FitResult(cid, None, 0, 0, down.get(cid, 0), error=reason)
        self._note(round_num, "fit_failures", {c: r for c, r in sorted(failures.items())})
        self._note(
            round_num,
            "fit_invalid",
            {c: r.error for c, r in sorted(results.items()) if r.error and c not in failures},
        )
        self._note(round_num, "nodes", dict(sorted(self.node_of.items())))
        return [results[cid] for cid in messages]

    def fit_secure(
        self, round_num: int, messages: dict[int, Payload], form: secure.SecureForm
    ) -> tuple[list[FitResult], secure.SecureSum | None]:
        """The round's fit by Flower's SecAgg+ workflow (``flower/secagg.py``)."""
        return secagg.fit(self, round_num, messages, form)

    def _fit_result(self, cid: int, reply: Message, down: int) -> FitResult:
        up = 0
        try:
            head = self._check_reply(cid, reply, m.FIT)
            up = wire_size(reply.content)
            m.check_payload_type(head, self.algo.Upload)
            n = m.int_field(head, "num-examples")
            expected = self.clients[cid].num_train
            if n != expected:
                raise PayloadError(f"claims {n} training examples; its partition has {expected}")
            loss = m.finite_or_nan(m.float_field(head, "loss"))
            upload = records_to_payload(self.algo.Upload, reply.content)  # size checked above
            attack = None
            if m.ATTACK in reply.content.config_records:
                data = self.clients[cid]
                record = reply.content.config_records[m.ATTACK]
                attack = m.parse_attack(record, data.num("train"), data.num("test"))
        except PayloadError as exc:
            error = f"SuperNode {self.node_of.get(cid)}: invalid reply: {exc}"
            return FitResult(cid, None, 0, up or content_bytes(reply.content), down, error=error)
        return FitResult(cid, upload, n, up, down, loss, attack=attack)

    def evaluate(
        self, round_num: int, messages: dict[int, Payload], receive: bool = True
    ) -> list[EvalResult]:
        contents = {
            cid: m.payload_message(
                msg, **{"client-id": cid, "round": round_num, "receive": receive}
            )
            for cid, msg in messages.items()
        }
        replies, failures, down = self._send(
            m.EVALUATE, round_num, contents, self.options.eval_timeout
        )
        out: list[EvalResult] = []
        up = 0
        for cid in messages:
            reply = replies.get(cid)
            if reply is None:
                continue
            try:
                self._check_reply(cid, reply, m.EVALUATE)
                counts_rec = reply.content.config_records.get(m.COUNTS)
                if counts_rec is None:
                    raise PayloadError("no counts")
                counts = m.parse_counts(counts_rec, self.eval_splits, 10**9)
                data = self.clients[cid]
                sizes = membership.sizes(data.num("train"), data.num("test"))
                for split, c in counts.items():
                    size = sizes[split] if split in sizes else data.num(split)
                    if c["n"] != size:
                        raise PayloadError(f"{split}: claims {c['n']} examples; it has {size}")
                up += wire_size(reply.content)
            except PayloadError as exc:
                failures[cid] = (
                    f"SuperNode {self.node_of.get(cid)}: invalid evaluation reply: {exc}"
                )
                continue
            out.append(EvalResult(cid, counts))
        for cid, reason in sorted(failures.items()):
            log.warning("round %d: no evaluation from client %d: %s", round_num, cid, reason)
        self._note(round_num, "eval_failures", dict(sorted(failures.items())))
        self._note(round_num, "eval_bytes_down", sum(down.values()))
        self._note(round_num, "eval_bytes_up", up)
        return out

    def finetune(self, messages: dict[int, Payload], phases: Sequence[Phase]) -> None:
        spec = m.phases_to_json(phases)
        contents = {
            cid: m.payload_message(msg, **{"client-id": cid, "phases": spec})
            for cid, msg in messages.items()
        }
        if self._on_finetune is not None:
            self._on_finetune(0, len(messages))
        replies, failures, _ = self._send(m.FINETUNE, 0, contents, self.options.eval_timeout)
        if self._on_finetune is not None:  # the replies are pulled together: all done at once
            self._on_finetune(len(messages), len(messages))
        for cid, reply in replies.items():
            try:
                self._check_reply(cid, reply, m.FINETUNE)
            except PayloadError as exc:
                failures[cid] = f"SuperNode {self.node_of.get(cid)}: invalid reply: {exc}"
        for cid, reason in sorted(failures.items()):
            log.warning("fine-tuning: client %d: %s", cid, reason)
        self._note(0, "finetune_failures", dict(sorted(failures.items())))

    # ---- client state, progress, shutdown -----------------------------------------------------
    def client_states(self) -> Sequence[ClientState]:
        """Always :class:`ClientStatesUnavailable`: each client's state lives in its SuperNode's
        ``context.state``, never sent to the server."""
        raise ClientStatesUnavailable(_ON_NODES)

    def load_client_states(self, states: Sequence[ClientState]) -> None:
        """Always :class:`ClientStatesUnavailable` (see :meth:`client_states`)."""
        raise ClientStatesUnavailable(_ON_NODES)

    def set_progress(
        self, on_client: ClientProgress | None, on_finetune: ClientProgress | None = None
    ) -> None:
        """Report each fit (and the fine-tuning): 0 clients when its messages go out, all when
        its replies are in."""
        self._on_client = on_client
        self._on_finetune = on_finetune

    def close(self) -> None:
        """Nothing to release: the grid and the SuperNodes belong to Flower's runtime."""
