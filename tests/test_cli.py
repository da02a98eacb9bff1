import csv
import json

from helpers.experiments import tiny_raw

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.cli import main


def _write_config(path, raw):
    lines = [f"seed = {raw['seed']}"]
    for section in ("data", "model", "train", "sim", "algorithm"):
        lines.append(f"[{section}]")
        for k, v in raw[section].items():
            lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")


def test_list_algorithms_shows_every_key(capsys):
    assert main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    keys = [line.split("\t")[0] for line in out.strip().splitlines()]
    assert keys == ALGORITHMS.names()
    assert "mu=" in out and "homogeneous only" in out


def test_list_models_counts_what_a_real_build_has(capsys):
    """Listed from meta-device builds (no weights drawn): the same counts as a real model."""
    from fedmosaic.core.registry import ENCODERS
    from fedmosaic.models import build_client_model
    from fedmosaic.models.flops import count_params, flops_per_image

    assert main(["list", "models"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.strip().splitlines()}
    assert list(rows) == ENCODERS.names()
    for name in ("cnn1", "resnet4", "mobilenetv2"):
        m = build_client_model(name, (1, 28, 28), 10, 512)
        params = int(rows[name].split("params=")[1].split()[0].replace(",", ""))
        mflops = float(rows[name].split("MFLOPs/image=")[1])
        assert params == count_params(m)
        assert mflops == round(flops_per_image(m, (1, 28, 28)) / 1e6, 2)


def test_run_writes_report(tmp_path, capsys):
    cfg = tmp_path / "exp.toml"
    _write_config(cfg, tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "lg_fedavg"}))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--set", "train.rounds=3"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["library"]["name"] == "fedmosaic" and doc["seed"] == 0
    assert [r["round"] for r in doc["rounds"]] == [1, 2, 3]
    for key in (
        "round",
        "acc_weighted",
        "acc_mean",
        "acc_std",
        "bytes_up",
        "bytes_down",
        "seconds",
    ):
        assert key in doc["rounds"][0]
    for key in ("client_id", "arch", "num_train", "num_test", "acc"):
        assert key in doc["clients"][0]
    assert {"final", "best_on_test"} <= set(doc["summary"])
    rows = list(csv.DictReader(open(out / "rounds.csv")))
    assert len(rows) == 3 and float(rows[-1]["acc_weighted"]) == doc["rounds"][-1]["acc_weighted"]
    assert (out / "curve.png").stat().st_size > 1000
    assert "lg_fedavg" in capsys.readouterr().out


def test_run_with_baseline_side_by_side(tmp_path, capsys):
    cfg = tmp_path / "exp.toml"
    _write_config(cfg, tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "lg_fedavg"}))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--baseline", "local"]) == 0
    assert (out / "lg_fedavg" / "results.json").exists() and (
        out / "local" / "results.json"
    ).exists()
    assert (out / "curves.png").exists()
    table = capsys.readouterr().out
    assert "lg_fedavg" in table and "local" in table


def test_config_error_exit_code(tmp_path, capsys):
    cfg = tmp_path / "exp.toml"
    _write_config(cfg, tiny_raw())
    assert main(["run", str(cfg), "--set", "data.alpah=1"]) == 2
    assert "data.alpah" in capsys.readouterr().err


def test_partition_prints_histograms(tmp_path, capsys):
    cfg = tmp_path / "exp.toml"
    _write_config(cfg, tiny_raw())
    png = tmp_path / "h.png"
    assert main(["partition", str(cfg), "--png", str(png)]) == 0
    assert png.exists()
    assert len(capsys.readouterr().out.strip().splitlines()) >= 4


def test_baseline_drops_the_methods_own_settings(tmp_path):
    """A config with method hyperparameters (`algorithm.lam`, from the file and from --set) still
    runs its --baseline: the baseline's [algorithm] is its name alone."""
    cfg = tmp_path / "exp.toml"
    _write_config(
        cfg, tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedproto", "lam": 0.5})
    )
    out = tmp_path / "out"
    argv = ["run", str(cfg), "--out", str(out), "--quiet", "--set", "algorithm.lam=0.25"]
    assert main([*argv, "--set", "train.rounds=1", "--baseline", "local"]) == 0
    ours = json.loads((out / "fedproto" / "results.json").read_text())["config"]["algorithm"]
    theirs = json.loads((out / "local" / "results.json").read_text())["config"]["algorithm"]
    assert ours == {"name": "fedproto", "lam": 0.25} and theirs == {"name": "local"}


def test_a_log_file_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """--log-file naming a directory, or on a read-only file system: one line naming the path,
    exit 2, and nothing run or written (setup_logging runs inside the error handling)."""
    import builtins
    import errno
    import os

    cfg = tmp_path / "exp.toml"
    _write_config(cfg, tiny_raw(train={"rounds": 1}))
    out = tmp_path / "out"
    folder = tmp_path / "logs"
    folder.mkdir()
    log = folder / "run.log"
    if os.geteuid() == 0:
        # root ignores permission bits: the file system refuses instead, as a read-only mount
        real = builtins.open

        def read_only(path, mode="r", *args, **kwargs):
            if str(path).startswith(str(folder)) and any(m in mode for m in "wax+"):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", read_only)  # what logging.FileHandler opens with
    else:
        folder.chmod(0o555)
    try:
        for path, says in ((folder, "is a directory"), (log, "")):
            capsys.readouterr()
            argv = ["run", str(cfg), "--out", str(out), "--quiet", "--log-file", str(path)]
            assert main(argv) == 2, path
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and str(path) in err[0] and says in err[0], err
            assert err[0].startswith("error: --log-file"), err
            assert not out.exists() and not log.exists()
    finally:
        folder.chmod(0o755)


def test_an_interrupted_default_run_resumes_when_the_same_command_runs_again(tmp_path, monkeypatch):
    """Without --out the run goes to runs/<config>-<hash>: interrupted after a few rounds (the
    stop flag Ctrl-C sets), the same command continues from the checkpoint and ends with the
    numbers of an uninterrupted run."""
    import threading
    import time as _time

    from helpers.experiments import numbers, tiny_raw, write_toml

    from fedmosaic.core.rounds import stop_requested

    cfg = write_toml(tmp_path / "long.toml", tiny_raw(train={"rounds": 24}))
    whole = tmp_path / "whole"
    assert main(["run", str(cfg), "--quiet", "--out", str(whole), "--checkpoint-every", "5"]) == 0
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def stop_after_round_6() -> None:
        deadline = _time.monotonic() + 120
        while _time.monotonic() < deadline:
            rows = list(work.glob("runs/long-*/rounds.csv"))
            if rows and len(rows[0].read_text().splitlines()) > 6:  # header + 6 rounds
                stop_requested.set()
                return
            _time.sleep(0.005)

    watcher = threading.Thread(target=stop_after_round_6)
    watcher.start()
    assert main(["run", str(cfg), "--quiet"]) == 130
    watcher.join()
    (folder,) = (work / "runs").iterdir()
    assert (folder / "checkpoint.safetensors").is_file() and not (folder / "results.json").exists()
    assert main(["run", str(cfg), "--quiet"]) == 0  # the same command: resumed, not restarted
    resumed = json.loads((folder / "results.json").read_text())
    assert numbers(resumed) == numbers(json.loads((whole / "results.json").read_text()))
    assert main(["run", str(cfg), "--quiet"]) == 0  # and once finished: already done, kept
