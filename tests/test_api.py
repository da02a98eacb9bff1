"""The public Python API: ``fedmosaic.api.run`` returns the trained models whichever backend
trained them, and ``load_run`` reloads a finished run's kept models from ``--save-models``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.experiments import tiny_raw, write_toml

import fedmosaic.api as fm
from fedmosaic.checkpoint import CheckpointError
from fedmosaic.cli import main
from fedmosaic.federation import build_federation

LG = {"model": {"family": "htfe2"}, "algorithm": {"name": "lg_fedavg"}}


def _accuracies(result: fm.Result) -> list[float]:
    """Each client's test accuracy recomputed from ``result.models`` (model(x), argmax)."""
    clients = build_federation(result.config, with_clients=False).clients
    accs = []
    for c, model in zip(clients, result.models, strict=True):
        correct = 0
        with torch.no_grad():
            for x, y in c.iter_batches("test", 1000):
                correct += int((model(x).argmax(1) == y).sum())
        accs.append(correct / c.num("test"))
    return accs


def _states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_run_returns_the_models_the_final_evaluation_saw(backend: str):
    raw = tiny_raw(**LG, sim={"backend": backend, "workers": 2, "threads": 1})
    result = fm.run(raw)
    assert isinstance(result, fm.Result) and result.rounds_done == 2
    assert result["rounds"] == result.rounds and result.summary["final"]["round"] == 2
    assert len(result.models) == len(result.extras) == 4
    assert _accuracies(result) == pytest.approx([c["acc"] for c in result.clients])
    assert set(result.server_state) and all(
        torch.isfinite(v).all() for v in result.server_state.values()
    )


def test_both_backends_return_the_same_models():
    serial = fm.run(tiny_raw(**LG, sim={"backend": "serial", "threads": 1}))
    procs = fm.run(tiny_raw(**LG, sim={"backend": "processes", "workers": 2, "threads": 1}))
    for a, b in zip(serial.models, procs.models, strict=True):
        assert _states_equal(a.state_dict(), b.state_dict())


def test_fine_tuning_methods_return_the_fine_tuned_models():
    result = fm.run(tiny_raw(algorithm={"name": "fedbabu"}, sim={"threads": 1}))
    assert "after_finetune" in result.summary
    assert _accuracies(result) == pytest.approx([c["finetuned_acc"] for c in result.clients])


def test_load_run_restores_the_kept_models(tmp_path: Path):
    raw = tiny_raw(**LG, sim={"backend": "processes", "workers": 2, "threads": 1})
    cfg = write_toml(tmp_path / "c.toml", raw)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    kept = fm.load_run(out)
    assert kept.rounds_done == 2 and kept.document["summary"]["final"]["round"] == 2
    assert _accuracies(kept) == pytest.approx([c["acc"] for c in kept.clients])
    fresh = fm.run(raw)  # the same run again: the same server state and models
    assert _states_equal(kept.server_state, fresh.server_state)
    for a, b in zip(kept.models, fresh.models, strict=True):
        assert _states_equal(a.state_dict(), b.state_dict())
    (out / "final.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="final.safetensors"):
        fm.load_run(out)


def test_a_run_keeps_no_models_unless_asked_and_load_run_says_so(tmp_path: Path, capsys):
    """No final.safetensors unasked (the default job wrote 225 MB per method); ``--save-models``
    keeps it and prints its size; ``load_run`` of a run without models says what to do."""
    raw = tiny_raw(data={"synthetic_shape": [1, 16, 16]}, train={"rounds": 1}, sim={"threads": 1})
    cfg = write_toml(tmp_path / "c.toml", raw)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    assert "models not kept (--save-models" in capsys.readouterr().out
    assert (out / "results.json").is_file() and not (out / "final.safetensors").exists()
    with pytest.raises(CheckpointError, match=r"kept no models.*--save-models --overwrite"):
        fm.load_run(out)
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    assert "it kept no models: add --overwrite" in capsys.readouterr().out
    args = ["run", str(cfg), "--out", str(out), "--quiet", "--save-models", "--overwrite"]
    assert main(args) == 0
    size = (out / "final.safetensors").stat().st_size
    assert (
        f"models kept: {out / 'final.safetensors'} ({size / 1e6:.1f} MB)" in capsys.readouterr().out
    )
    assert fm.load_run(out).rounds_done == 1
    # A checkpoint is for resuming after a crash: a finished run removes it and says so.
    other = tmp_path / "ck"
    assert main(["run", str(cfg), "--out", str(other), "--quiet", "--checkpoint-every", "1"]) == 0
    assert "resume checkpoint removed as the run finished" in capsys.readouterr().out
    assert not (other / "checkpoint.safetensors").exists()


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory) -> Path:
    """A finished ``--save-models`` run folder of a tiny federation (copied by each test)."""
    folder = tmp_path_factory.mktemp("kept")
    raw = tiny_raw(data={"synthetic_shape": [1, 16, 16]}, train={"rounds": 1}, sim={"threads": 1})
    raw["sim"]["check_wire"] = False
    cfg = write_toml(folder / "c.toml", raw)
    out = folder / "o"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    return out


def _with_plugin(kept_run: Path, tmp_path: Path, recompute_digest: bool) -> tuple[Path, Path]:
    """A copy of ``kept_run`` whose stored config names a plugin that leaves a marker file when
    imported; ``recompute_digest``: a consistent file, else an edited one (stale digest)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from fedmosaic import checkpoint as ck

    out = tmp_path / "run"
    shutil.copytree(kept_run, out)
    marker = tmp_path / "plugin_ran"
    plugin = tmp_path / "evil.py"
    plugin.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    final = out / "final.safetensors"
    loaded = ck.read_checkpoint(final)
    with safe_open(str(final), framework="pt") as fh:
        header = dict(fh.metadata())
    meta = dict(loaded.meta)
    meta["config"] = {**meta["config"], "plugins": [str(plugin)]}
    header["meta"] = json.dumps(meta, allow_nan=True, separators=(",", ":"))
    if recompute_digest:
        header["digest"] = ck._digest(header["meta"], loaded.tensors)
    save_file(loaded.tensors, str(final), metadata=header)
    return out, marker


def test_load_run_imports_no_plugin_without_consent(kept_run: Path, tmp_path: Path):
    out, marker = _with_plugin(kept_run, tmp_path, recompute_digest=True)
    with pytest.raises(CheckpointError, match=r"evil\.py.*trust_plugins=True"):
        fm.load_run(out)
    with pytest.raises(CheckpointError, match=r"evil\.py"):
        fm.load_run(out, plugins=["other.py"])  # consent to another plugin is not consent
    assert not marker.exists()
    kept = fm.load_run(out, trust_plugins=True)
    assert marker.exists() and kept.rounds_done == 1


def test_load_run_with_the_plugin_named_by_the_caller(kept_run: Path, tmp_path: Path):
    out, marker = _with_plugin(kept_run, tmp_path, recompute_digest=True)
    assert fm.load_run(out, plugins=[str(tmp_path / "evil.py")]).rounds_done == 1
    assert marker.exists()


def test_load_run_checks_the_digest_before_it_imports_anything(kept_run: Path, tmp_path: Path):
    out, marker = _with_plugin(kept_run, tmp_path, recompute_digest=False)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        fm.load_run(out)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="digest mismatch"):
        fm.load_run(out, trust_plugins=True)  # consent is no reason to trust an edited file
    assert not marker.exists()


def test_run_flower_in_memory_goes_through_the_run_folder_lifecycle(tmp_path: Path, monkeypatch):
    """results_dir is locked and checked as `fedmosaic run --out` is: a folder in use or holding
    another config's results is refused with nothing written; this config's finished run is
    returned as it is (nothing runs) unless overwrite."""
    pytest.importorskip("flwr")
    import fedmosaic.flower.app as app
    from fedmosaic.runfolder import FolderLock

    ran: list[str] = []
    monkeypatch.setattr(
        app, "run_server", lambda grid, rc, **kw: ran.append(rc["results-dir"]) or {}
    )
    raw = tiny_raw(train={"rounds": 1})
    cfg = fm.experiment_config(raw)
    out = tmp_path / "flower"
    with FolderLock(out):
        with pytest.raises(fm.RunFolderError, match="in use by another run"):
            fm.run_flower_in_memory(raw, out)
    assert ran == [] and not out.exists()
    out.mkdir()
    other = fm.experiment_config(tiny_raw(train={"rounds": 1, "lr": 0.2})).to_dict()
    (out / "results.json").write_text(json.dumps({"config": other}))
    with pytest.raises(fm.ConfigError, match="another configuration"):
        fm.run_flower_in_memory(raw, out)
    assert ran == [] and json.loads((out / "results.json").read_text())["config"] == other
    (out / "results.json").write_text(json.dumps({"config": cfg.to_dict(), "kept": True}))
    assert fm.run_flower_in_memory(raw, out)["kept"] is True and ran == []
    fm.run_flower_in_memory(raw, out, overwrite=True)
    assert ran == [str(out)]
