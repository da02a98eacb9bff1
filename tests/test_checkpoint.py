"""Checkpoint/resume: the generic flattener, corrupt and foreign files, SIGKILL + resume."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.experiments import SMALL, run_until_round, tiny_raw, write_toml
from safetensors.torch import save_file
from torch import nn

from fedmosaic import checkpoint as ck
from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.checkpoint import CheckpointError, CheckpointPolicy, flatten_tree, restore_tree
from fedmosaic.cli import main
from fedmosaic.config import from_dict
from fedmosaic.core.rounds import History
from fedmosaic.experiment import run_experiment


@dataclass
class Inner:
    w: torch.Tensor
    steps: int


@dataclass(frozen=True)
class State:
    head: dict[str, torch.Tensor]
    inner: Inner
    cache: dict[int, torch.Tensor] = field(default_factory=dict)
    names: tuple[tuple[str, ...], ...] = ()
    loss: float = math.nan
    flag: bool = False
    label: str | None = None


def _state(seed: int) -> State:
    torch.manual_seed(seed)
    shared = torch.randn(3)
    return State(
        head=dict(nn.Linear(4, 2).state_dict()),
        inner=Inner(shared, seed),
        cache={1: shared, 7: torch.arange(4)},
        names=(("a", "b"), ("c",)),
        loss=math.nan if seed == 0 else 0.5,
        flag=seed == 0,
        label="x" if seed else None,
    )


def test_tree_roundtrip_restores_every_leaf_and_aliasing():
    saved = _state(0)
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_tree(saved, tensors, "server")
    json.dumps(tree)  # the structure is plain JSON
    back = restore_tree(json.loads(json.dumps(tree)), tensors, _state(1))
    assert type(back) is State and type(back.inner) is Inner
    assert torch.equal(back.head["weight"], saved.head["weight"])
    assert torch.equal(back.inner.w, saved.inner.w) and back.inner.steps == 0
    assert back.cache[1] is back.inner.w  # one tensor object, as saved
    assert sorted(back.cache) == [1, 7] and back.names == (("a", "b"), ("c",))
    assert math.isnan(back.loss) and back.flag is True and back.label is None


def test_unsupported_value_fails_naming_its_path():
    with pytest.raises(CheckpointError, match=r"server\.inner\.w: cannot checkpoint .*object"):
        flatten_tree(State({}, Inner(object(), 0)), {}, "server")  # type: ignore[arg-type]
    # Server states are plain data: a module (or a generator) is refused by its path.
    with pytest.raises(CheckpointError, match=r"server\.head: .*Linear.*plain data"):
        flatten_tree(State(nn.Linear(1, 1), Inner(torch.zeros(1), 0)), {}, "server")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"server\[0\]: .*Generator"):
        flatten_tree([torch.Generator()], {}, "server")


def test_foreign_structure_is_rejected():
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_tree(_state(0), tensors, "server")
    with pytest.raises(CheckpointError, match="checkpoint has a 'State'"):
        restore_tree(tree, tensors, {"w": torch.zeros(2)})
    plain: dict[str, torch.Tensor] = {}
    tree = flatten_tree({"w": torch.ones(2)}, plain, "server")
    assert restore_tree(tree, plain, None)["w"].tolist() == [
        1.0,
        1.0,
    ]  # plain data needs no template


def _good(tmp_path: Path) -> Path:
    path = tmp_path / ck.FILENAME
    ck.write_checkpoint(path, {"version": ck.VERSION, "round": 3}, {"a": torch.arange(100.0)})
    return path


def test_a_diverged_clients_nan_state_is_kept_and_a_nan_server_state_refused(tmp_path: Path):
    # A client whose training blew up keeps running in the federation (its uploads refused):
    # its state is saved and resumed as it is; the server's state is never legitimately NaN.
    nan = torch.tensor([1.0, math.nan])
    path = tmp_path / ck.FILENAME
    ck.write_checkpoint(path, {"version": ck.VERSION, "round": 3}, {"client/15/model/w": nan})
    back = ck.read_checkpoint(path).tensors["client/15/model/w"]
    assert back[0] == 1.0 and math.isnan(back[1])
    with pytest.raises(CheckpointError, match="tensor 'server/w' has NaN or infinite values"):
        ck.write_checkpoint(
            tmp_path / "s.st", {"version": ck.VERSION, "round": 3}, {"server/w": nan}
        )


def test_corrupt_or_foreign_files_fail_clearly(tmp_path: Path):
    path = _good(tmp_path)
    assert ck.read_checkpoint(path).meta["round"] == 3
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one flipped bit in a tensor
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        ck.read_checkpoint(bad)
    trunc = tmp_path / "truncated.safetensors"
    trunc.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        ck.read_checkpoint(trunc)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01 not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        ck.read_checkpoint(junk)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="foreign"):
        ck.read_checkpoint(foreign)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch):
    path = _good(tmp_path)
    before = path.read_bytes()

    def half_write(spool, out, metadata):
        out.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck.Spool, "write_file", half_write)
    with pytest.raises(OSError, match="disk full"):
        ck.write_checkpoint(path, {"version": ck.VERSION, "round": 4}, {"a": torch.zeros(1)})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [ck.FILENAME]  # no temporary left behind


def test_a_write_never_touches_another_writers_temporary(tmp_path: Path, monkeypatch):
    """Temporaries are unique per write (pid + random part) and only their writer removes them:
    another process's write in progress survives ours; a dead writer's is removed when the run
    folder is next locked (runfolder)."""
    from fedmosaic.runfolder import FolderLock

    path = _good(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        theirs = tmp_path / f"{ck.FILENAME}.tmp-{live.pid}-0123abcd"  # a write in progress
        theirs.write_bytes(b"their half-written checkpoint")
        killed = tmp_path / f"{ck.FILENAME}.tmp-{dead.pid}-4567cdef"  # its writer was killed
        killed.write_bytes(b"half")
        seen = []
        real = ck.Spool.write_file

        def spy(spool, out, metadata):
            seen.append(Path(out.name).name)
            return real(spool, out, metadata)

        monkeypatch.setattr(ck.Spool, "write_file", spy)
        for r in (5, 6):
            ck.write_checkpoint(path, {"version": ck.VERSION, "round": r}, {"a": torch.zeros(1)})
        assert ck.read_checkpoint(path).meta["round"] == 6
        assert len(set(seen)) == 2 and all(f"tmp-{os.getpid()}-" in n for n in seen), seen
        assert theirs.read_bytes() == b"their half-written checkpoint"
        assert killed.exists()  # not the writer's to judge; the folder's lock is
        with FolderLock(tmp_path):
            assert theirs.exists() and not killed.exists()
    finally:
        live.kill()
        live.wait()


def _without_timing(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    doc.pop("wall_seconds", None)
    doc.pop("provenance", None)  # start/finish times, the command
    doc["summary"].pop("seconds_per_round", None)
    for r in doc["rounds"]:
        for k in [k for k in r if k.startswith("seconds")]:
            del r[k]
    return doc


def _write_tiny_toml(path: Path, algorithm: str, rounds: int) -> Path:
    raw = tiny_raw(data=SMALL, train={"rounds": rounds}, algorithm={"name": algorithm})
    raw["sim"]["check_wire"] = False
    return write_toml(path, raw)


def test_sigkill_then_resume_gives_the_same_results(tmp_path: Path):
    cfg = _write_tiny_toml(tmp_path / "tiny.toml", "fedtgp", rounds=3)
    assert main(["run", str(cfg), "--out", str(tmp_path / "ref"), "--quiet"]) == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "fedmosaic.cli", "run", str(cfg), "--out", str(out), "--quiet"]
    env = {**os.environ, ck.KILL_ENV: "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--checkpoint-every", "1"], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # SIGKILLed itself after round 2
    assert ck.peek(out / ck.FILENAME)["round"] == 2 and not (out / "results.json").exists()
    # Without --resume the interrupted run's checkpoint is not overwritten.
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--checkpoint-every", "1"]) == 2
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--resume"]) == 0
    ref = json.loads((tmp_path / "ref" / "results.json").read_text())
    got = json.loads((out / "results.json").read_text())
    assert _without_timing(got) == _without_timing(ref)
    assert not (out / ck.FILENAME).exists()  # a complete run removes its checkpoint
    rows = (out / "rounds.csv").read_text().strip().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]


def test_resume_with_another_config_fails_naming_the_key(tmp_path: Path):
    cfg = from_dict(tiny_raw(data=SMALL, train={"rounds": 2}, algorithm={"name": "local"}))
    run_experiment(cfg, progress=False, checkpoint=CheckpointPolicy(tmp_path, every=1))
    other = from_dict(
        tiny_raw(data=SMALL, train={"rounds": 2, "lr": 0.1}, algorithm={"name": "local"})
    )
    with pytest.raises(CheckpointError, match=r"train\.lr: checkpoint 0\.05, now 0\.1"):
        run_experiment(other, progress=False, checkpoint=CheckpointPolicy(tmp_path, resume=True))


# Every method in the registry (server states of every kind: dicts of tensors, dataclasses with
# modules, generator networks, caches keyed by round, SVD messages, coefficient matrices), with
# half the clients per round so that clients with local state sit out rounds across the resume.
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_interrupted_and_resumed_run_is_identical(tmp_path: Path, monkeypatch, name: str):
    family = "htfe8-gray" if ALGORITHMS.get(name).supports_heterogeneous else "cnn1"
    raw = tiny_raw(
        data=SMALL,
        model={"family": family},
        train={"rounds": 3, "participation": 0.5},
        algorithm={"name": name},
    )
    raw["sim"]["check_wire"] = False
    cfg = from_dict(raw)
    ref = run_experiment(cfg, progress=False)
    run_until_round(cfg, 2, tmp_path, monkeypatch)
    got = run_experiment(cfg, progress=False, checkpoint=CheckpointPolicy(tmp_path, resume=True))
    assert _without_timing(got) == _without_timing(ref)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedtgp"])
def test_saved_models_extend_a_finished_run_as_if_it_had_run_longer(tmp_path: Path, algorithm):
    cfg = _write_tiny_toml(tmp_path / "tiny.toml", algorithm, rounds=2)
    straight = tmp_path / "straight"
    assert (
        main(["run", str(cfg), "--out", str(straight), "--quiet", "--set", "train.rounds=4"]) == 0
    )
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    final = out / "final.safetensors"
    assert ck.peek(final)["round"] == 2 and not (out / ck.FILENAME).exists()
    loaded = ck.read_checkpoint(final)
    assert any(k.startswith("client/0/model/") for k in loaded.tensors)  # the trained models
    # Anything but the number of rounds changed: refused, nothing touched.
    before = (out / "results.json").read_bytes()
    bad = ["--extend", "--set", "train.rounds=4", "--set", "train.lr=0.2"]
    assert main(["run", str(cfg), "--out", str(out), "--quiet", *bad]) == 2
    assert (out / "results.json").read_bytes() == before
    ok = ["--extend", "--set", "train.rounds=4"]
    assert main(["run", str(cfg), "--out", str(out), "--quiet", *ok]) == 0
    got = json.loads((out / "results.json").read_text())
    ref = json.loads((straight / "results.json").read_text())
    assert [r["round"] for r in got["rounds"]] == [1, 2, 3, 4]
    assert _without_timing(got)["rounds"] == _without_timing(ref)["rounds"]
    assert got["per_client_final_acc"] == ref["per_client_final_acc"]
    rows = (out / "rounds.csv").read_text().strip().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    assert ck.peek(final)["round"] == 4  # the kept state follows the extended run


def test_a_forged_state_of_the_wrong_kind_is_refused_by_its_path():
    tensors: dict[str, torch.Tensor] = {}
    template = {"w": torch.zeros(2), "inner": Inner(torch.zeros(1), 0)}
    tree = flatten_tree({"w": torch.ones(2), "inner": Inner(torch.ones(1), 3)}, tensors, "server")
    assert restore_tree(tree, tensors, template)["inner"].steps == 3
    for node in (5, None, "x", {"t": "list", "items": []}, {"t": "float", "v": "nan"}):
        with pytest.raises(
            CheckpointError, match=r"^state: the checkpoint has .* this run has a dict"
        ):
            restore_tree(node, tensors, template)
    forged = json.loads(json.dumps(tree))
    forged["items"][0][1] = 5  # a number where the run has a tensor
    with pytest.raises(
        CheckpointError, match=r"state\['w'\]: .*the value 5 where this run has a tensor"
    ):
        restore_tree(forged, tensors, template)
    forged = json.loads(json.dumps(tree))
    forged["items"][1][1]["fields"]["w"] = {"t": "dict", "items": []}
    with pytest.raises(CheckpointError, match=r"state\['inner'\]\.w: .*a dict where .* a tensor"):
        restore_tree(forged, tensors, template)


@pytest.mark.parametrize("where", ["client/", "server/"])
def test_a_forged_checkpoint_with_huge_weights_is_refused(tmp_path: Path, monkeypatch, where):
    cfg = from_dict(tiny_raw(data=SMALL, train={"rounds": 2}, algorithm={"name": "fedavg"}))
    run_until_round(cfg, 1, tmp_path, monkeypatch)
    path = tmp_path / ck.FILENAME
    loaded = ck.read_checkpoint(path)
    key = next(
        k for k, v in loaded.tensors.items() if k.startswith(where) and v.is_floating_point()
    )
    tensors = {**loaded.tensors, key: loaded.tensors[key].clone().fill_(1e30)}
    meta_json = json.dumps(loaded.meta, allow_nan=True, separators=(",", ":"))
    header = {"format": ck.FORMAT, "meta": meta_json, "digest": ck._digest(meta_json, tensors)}
    save_file(tensors, str(path), metadata=header)  # digest recomputed: only the values lie
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=f"{path}: tensor '{key}' holds 1e\\+30"):
        run_experiment(cfg, progress=False, checkpoint=CheckpointPolicy(tmp_path, resume=True))
    assert path.read_bytes() == before


@pytest.mark.golden
def test_a_later_key_at_its_old_behaviour_keeps_stored_hashes() -> None:
    """``server.peer_factor`` came after the committed cells and checkpoints: at its default
    (which drops no honest upload) a config hashes as one recorded without the key, so stored
    cells are not re-run and checkpoints still resume; another value is another config."""
    from fedmosaic.checkpoint import config_hash

    cfg = from_dict(tiny_raw()).to_dict()
    assert cfg["server"]["peer_factor"] == 10.0
    old = json.loads(json.dumps(cfg))
    del old["server"]["peer_factor"]
    assert config_hash(cfg) == config_hash(old)
    cfg["server"]["peer_factor"] = 0.0
    assert config_hash(cfg) != config_hash(old)


@pytest.mark.parametrize(
    ("section", "key", "other"),
    [("train", "shuffle", False), ("model", "init", "architecture"), ("data", "split_seed", 3)],
)
@pytest.mark.golden
def test_the_reference_pipeline_options_keep_stored_hashes_at_their_defaults(
    section: str, key: str, other: object
) -> None:
    """``train.shuffle``, ``model.init`` and ``data.split_seed`` came after the committed cells: at
    their defaults a config hashes as one recorded without them; another value is another config."""
    from fedmosaic.checkpoint import config_hash

    cfg = from_dict(tiny_raw()).to_dict()
    old = json.loads(json.dumps(cfg))
    del old[section][key]
    assert config_hash(cfg) == config_hash(old)
    cfg[section][key] = other
    assert config_hash(cfg) != config_hash(old)


@pytest.mark.golden
def test_committed_cells_keep_their_config_hashes() -> None:
    """A committed cell's config, rebuilt by today's code, hashes as the stored one (else
    ``compare`` would run every committed cell again)."""
    from fedmosaic.checkpoint import config_hash
    from fedmosaic.suite_runner import build_cells, load_suite

    root = Path(__file__).resolve().parents[1] / "docs" / "results" / "converged"
    doc = json.loads(
        (root / "fedgh_table3/cells/pathological/fedgh/seed0/results.json").read_text()
    )
    (cell,) = build_cells(
        load_suite("fedgh_table3"),
        converged=True,
        methods=["fedgh"],
        settings=["pathological"],
        seeds=[0],
        check=False,
    )
    assert cell.hash == config_hash(doc["config"])


class _CountedClients(Sequence[ck.ClientState]):
    """A population whose clients are built when indexed (as an offloaded store reads them),
    counting at each read how many client-sized tensors (the reads' or copies of them) are
    alive in the process."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel
        self.most = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, cid):  # type: ignore[override]
        if not 0 <= cid < self.n:
            raise IndexError(cid)
        gc.collect()
        alive = sum(
            1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == self.numel
        )
        self.most = max(self.most, alive)
        return {"w": torch.full((self.numel,), float(cid))}, {"b": torch.tensor([cid])}


def test_a_checkpoint_is_written_and_read_one_client_at_a_time(tmp_path: Path):
    """The writer keeps no client's tensors after spooling them (at most the client being copied
    and the next one, as the loop moves on), and a resume hands the clients over as read."""
    # 10 clients: each read scans the process's objects (about a second in a full test worker)
    clients = _CountedClients(10, 12345)
    path = tmp_path / ck.FILENAME
    cfg = {"train": {"rounds": 1}, "data": {"num_clients": 10}}
    saver = ck.Checkpointer(path, 1, cfg, lambda: clients, lambda s: None)
    saver.save(1, {"w": torch.ones(3)}, History(rounds=[{"round": 1}]), [])
    assert clients.most <= 2, clients.most  # gathering every client first would reach 10
    got: list[Any] = []

    def set_clients(states: Sequence[ck.ClientState]) -> None:
        assert not isinstance(states, list)  # a reader, not the population in memory
        assert len(states) == 10
        for model, extras in states:
            got.append((float(model["w"][0]), int(extras["b"][0]), model["w"].numel()))

    loader = ck.Checkpointer(path, 1, cfg, lambda: [], set_clients, resume=True)
    loader.restore({"w": torch.zeros(3)})
    assert got == [(float(c), c, 12345) for c in range(10)]


def test_a_checkpoint_written_whole_by_safetensors_still_loads(tmp_path: Path):
    """Files written before streaming (safetensors' ``save_file``, one dict) verify and read as
    before; the streamed file holds the same tensors under the same digest."""
    tensors = {"client/0/model/w": torch.arange(6.0).reshape(2, 3), "rng/x": torch.arange(3)}
    meta = {"version": ck.VERSION, "round": 2}
    meta_json = json.dumps(meta, separators=(",", ":"))
    header = {"format": ck.FORMAT, "meta": meta_json, "digest": ck._digest(meta_json, tensors)}
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=header)
    new = tmp_path / "new.safetensors"
    ck.write_checkpoint(new, meta, tensors)
    assert ck.verify_file(old) == ck.verify_file(new) == meta
    assert ck.read_header(old)["digest"] == ck.read_header(new)["digest"]
    a, b = ck.read_checkpoint(old).tensors, ck.read_checkpoint(new).tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
