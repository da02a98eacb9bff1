"""docs/extending.md runs as written: its ``# file: NAME`` blocks (a dataset, an encoder and a
method as plugins in a user folder, a config, a shell script and a Python script) are written into
a fresh folder and run there, in fresh interpreters as a user would; every backend (serial,
processes, in-memory Flower; CLI and Python API) must give the same numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
BLOCK = re.compile(r"```\w*\n# file: (\S+)\n(.*?)```", re.S)


def blocks() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in BLOCK.finditer(DOC.read_text())}


def test_the_doc_has_every_piece():
    assert set(blocks()) == {
        "stripes.py",
        "stripes_mlp.py",
        "fedavg_slr.py",
        "stripes.toml",
        "run.sh",
        "run_all.py",
    }
    # Plugins use the public API only.
    for name in ("stripes.py", "stripes_mlp.py", "fedavg_slr.py"):
        imports = re.findall(r"^from (fedmosaic\S*) import", blocks()[name], re.M)
        assert imports == ["fedmosaic.api"], (name, imports)


def test_the_tutorial_runs_identically_on_every_backend(tmp_path: Path):
    for name, text in blocks().items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["FEDMOSAIC_KERNELS"] = env.get("FEDMOSAIC_KERNELS", "0")
    for cmd in (["bash", "run.sh"], [sys.executable, "run_all.py"]):
        done = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
        )
        assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    # run_all.py asserts equality itself; check its printed table independently.
    rows = dict(
        line.split(None, 1)
        for line in done.stdout.splitlines()
        if line.split(None, 1)[0]
        in {"serial", "processes", "flower", "cli-serial", "cli-processes"}
    )
    assert len(rows) == 5 and len(set(rows.values())) == 1, rows
    assert "server_lr = 1 equals fedavg: True" in done.stdout
    docs = {
        b: json.loads((tmp_path / "runs" / b / "results.json").read_text())
        for b in ("cli-serial", "cli-processes", "flower")
    }
    accs = {b: [r["acc_weighted"] for r in d["rounds"]] for b, d in docs.items()}
    # The method learns its task: far above chance (4 classes: 25%), the loss well down.
    losses = [r["train_loss"] for r in docs["cli-serial"]["rounds"]]
    assert accs["cli-serial"][-1] >= 0.9 and accs["cli-serial"][-1] - accs["cli-serial"][0] >= 0.3
    assert losses[-1] < 0.25 * losses[0] and losses == sorted(losses, reverse=True)
    assert (
        len(accs["flower"]) == 5 and accs["cli-serial"] == accs["cli-processes"] == accs["flower"]
    )
    # The API wrote the CLI's folder and called back after every round.
    api = json.loads((tmp_path / "runs" / "api-serial" / "results.json").read_text())
    assert [r["acc_weighted"] for r in api["rounds"]] == accs["cli-serial"]
    shown = re.findall(r"^round (\d)/5: loss [\d.]+, test ([\d.]+)%$", done.stdout, re.M)
    assert shown == [(str(i), f"{100 * a:.1f}") for i, a in enumerate(accs["cli-serial"], 1)]
    assert docs["flower"]["runtime"] == "flower"
    assert docs["cli-serial"]["config"]["algorithm"] == {"name": "fedavg_slr", "server_lr": 0.5}
    assert {c["arch"] for c in docs["cli-serial"]["clients"]} == {"stripes_mlp"}
    assert docs["cli-serial"]["per_client_final_acc"] == docs["flower"]["per_client_final_acc"]
