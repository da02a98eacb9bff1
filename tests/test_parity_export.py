"""The parity harness (benchmarks/parity/) without a reference checkout: its export writes exactly
the clients' rows in the reference's layout, its reader parses the reference's stdout, and its
configs are valid fedmosaic configs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from fedmosaic.config import DataConfig, from_dict
from fedmosaic.data.federated import build_federated_data

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "parity" / "harness.py"
GRAD_NORMS = HARNESS.parent / "grad_norms.py"


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("parity_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report() -> ModuleType:
    """``benchmarks/parity/report.py``, loaded once."""
    spec = importlib.util.spec_from_file_location("parity_report", HARNESS.parent / "report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny() -> DataConfig:
    return DataConfig(
        dataset="synthetic",
        synthetic_size=240,
        synthetic_classes=4,
        synthetic_shape=[1, 6, 6],
        partition="dirichlet",
        alpha=0.5,
        num_clients=5,
        min_size=5,
    )


def test_export_writes_exactly_the_clients_rows(harness: ModuleType, tmp_path: Path) -> None:
    fd = build_federated_data(_tiny(), seed=3)
    dest = tmp_path / "dataset" / "tiny"
    config = harness.export(fd, dest)
    assert sorted(p.name for p in (dest / "train").iterdir()) == [f"{i}.npz" for i in range(5)]
    for split in ("train", "test"):
        for cid, cs in enumerate(fd.clients):
            x, y, rows = harness.read_export(dest, split, cid)
            want = cs.get(split)
            assert rows.dtype == np.int64 and np.array_equal(rows, want.numpy())
            assert y.dtype == np.int64 and np.array_equal(y, fd.labels[want].numpy())
            # the very float32 values fedmosaic's clients are fed (normalize = "half")
            assert x.dtype == np.float32 and x.shape == (len(want), 1, 6, 6)
            assert torch.equal(torch.from_numpy(x), fd.batch(want))
            assert x.min() >= -1.0 and x.max() <= 1.0
    on_disk = json.loads((dest / "config.json").read_text())
    assert on_disk == config
    assert config["train_sizes"] == [int(cs.train.numel()) for cs in fd.clients]
    assert config["test_sizes"] == [int(cs.test.numel()) for cs in fd.clients]
    assert not list(dest.rglob("*.tmp"))  # written atomically: no temporary file left


def test_export_refuses_a_validation_split(harness: ModuleType, tmp_path: Path) -> None:
    cfg = _tiny()
    cfg.val_fraction = 0.2
    with pytest.raises(ValueError, match="val_fraction"):
        harness.export(build_federated_data(cfg, seed=0), tmp_path / "d")


FAKE_LOG = """\
parity launch shim: stand-ins for ['torchvision']
-------------Round number: 0-------------

Evaluate heterogeneous models
Client 0: Acc: 0.0, AUC: 0
Client 1: Acc: 0.0, AUC: 0
Client 2: Acc: 0.0, AUC: 0
Averaged Test Accurancy: 0.0000
Std Test Accurancy: 0.0000
-------------------------------------------------- 1.5

-------------Round number: 1-------------

Evaluate heterogeneous models
Client 0: Acc: 0.5, AUC: 0.9
Client 1: Acc: 1.0, AUC: 1.0
Client 2: Acc: 0.25, AUC: 0.7
Averaged Test Accurancy: 0.3636
Std Test Accurancy: 0.3118
"""


def test_reader_parses_the_reference_stdout(harness: ModuleType) -> None:
    rounds = harness.parse_reference_log(FAKE_LOG, test_sizes=[2, 1, 8])
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[0]["acc_weighted"] == 0.0 and rounds[0]["acc_mean"] == 0.0
    r1 = rounds[1]
    assert r1["client_acc"] == [0.5, 1.0, 0.25]
    assert r1["acc_weighted"] == pytest.approx((1 + 1 + 2) / 11)
    assert r1["acc_mean"] == pytest.approx(1.75 / 3)
    assert r1["acc_printed"] == 0.3636


def test_reader_rejects_a_missing_client(harness: ModuleType) -> None:
    broken = FAKE_LOG.replace("Client 1: Acc: 1.0, AUC: 1.0\n", "")
    with pytest.raises(ValueError, match="client lines"):
        harness.parse_reference_log(broken, test_sizes=[2, 1, 8])


def test_reader_rejects_other_test_sizes(harness: ModuleType) -> None:
    # the printed correct/total disagrees with the client lines weighted by these sizes: the log
    # is not a run on this export
    with pytest.raises(ValueError, match="printed"):
        harness.parse_reference_log(FAKE_LOG, test_sizes=[1, 1, 1])


# PFLlib's spelling ("Accuracy"), per-client lines printed by the launch shim, and FedBABU's
# evaluation after fine-tuning (no round number)
PFLLIB_LOG = """\
-------------Round number: 2-------------

Evaluate global model
Client 0: Acc: 0.5
Client 1: Acc: 1.0
Averaged Train Loss: 1.2345
Averaged Test Accuracy: 0.6667
Averaged Test AUC: 0.9000

-------------Evaluate fine-tuned personalized models-------------
Client 0: Acc: 1.0
Client 1: Acc: 0.0
Averaged Train Loss: 0.1000
Averaged Test Accuracy: 0.6667
"""


def test_reader_parses_pfllib_and_its_finetuned_evaluation(harness: ModuleType) -> None:
    rounds = harness.parse_reference_log(PFLLIB_LOG, test_sizes=[4, 2])
    assert [(r["round"], r.get("finetuned", False)) for r in rounds] == [(2, False), (2, True)]
    assert rounds[0]["acc_weighted"] == pytest.approx(4 / 6)
    assert rounds[0]["acc_mean"] == pytest.approx(0.75)
    assert rounds[1]["client_acc"] == [1.0, 0.0] and rounds[1]["acc_mean"] == 0.5


def test_every_method_config_is_valid(harness: ModuleType) -> None:
    for lib_key, lib in harness.LIBRARIES.items():
        for setting in harness.SETTINGS:
            setup = harness.Setup(setting=setting, rounds=3, library=lib_key)
            assert setup.name.startswith(lib.dataset_prefix)
            for name, method in lib.methods.items():
                variants = [{**method.algorithm, **v} for v in method.variants.values()]
                for algorithm in [method.algorithm, *variants]:
                    cfg = from_dict(setup.fedmosaic_config(algorithm, method.plugins))
                    assert cfg.algorithm["name"] == method.algorithm["name"], name
                    assert cfg.model.family == lib.model["family"]
                    assert cfg.data.val_fraction == 0.0 and cfg.train.drop_last
                assert "-algo" in method.ref_args
                command = harness._ref_command("py", setup, method)
                assert command[command.index("-m") + 1] == lib.model_args[1]
    pipeline = harness.HTFLLIB["fedproto"].variants["pipeline"]
    cfg = from_dict(harness.Setup().fedmosaic_config({"name": "fedproto", **pipeline}))
    assert cfg.train.shuffle is False and cfg.model.init == "architecture"
    assert "train.shuffle" not in cfg.algorithm
    # PFLlib builds the 28x28 FedAvgCNN only for dataset names containing "MNIST"
    assert "MNIST" in harness.Setup(library="pfllib").name


def test_shim_prints_client_accuracies_without_changing_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in for the reference's flcore.servers.serverbase (cwd = its system/)
    pkg = tmp_path / "flcore" / "servers"
    pkg.mkdir(parents=True)
    (tmp_path / "flcore" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "serverbase.py").write_text(
        "class Server:\n"
        "    def test_metrics(self):\n"
        "        return [3, 5], [4, 2], [1.0, 2.0], [0.5, 0.5]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("flcore", "flcore.servers", "flcore.servers.serverbase"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    spec = importlib.util.spec_from_file_location("parity_shim", HARNESS.parent / "launch_shim.py")
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    shim.print_client_accuracies()
    from flcore.servers import serverbase  # type: ignore[import-not-found]

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        stats = serverbase.Server().test_metrics()
    assert stats == ([3, 5], [4, 2], [1.0, 2.0], [0.5, 0.5])
    assert out.getvalue() == "Client 3: Acc: 0.25\nClient 5: Acc: 1.0\n"


def test_shim_seed_offset_shifts_every_torch_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("parity_shim2", HARNESS.parent / "launch_shim.py")
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    original = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", original)  # restored after the test
    original(3)
    want = torch.rand(4)
    shim.offset_torch_seeds(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(4), want)


def _fake_run(gap: float) -> dict:
    ref = [{"round": r, "acc_weighted": 0.5 + r / 100, "acc_mean": 0.4 + r / 100} for r in range(7)]
    fm = [
        {"round": r, "acc_weighted": 0.5 + r / 100 + gap, "acc_mean": 0.4 + r / 100 + gap}
        for r in range(1, 7)
    ]
    return {
        "method": "local",
        "setting": "dir01",
        "setup": {"seed": 0},
        "reference": {"library": "HtFLlib", "rounds": ref, "seconds": 1.0},
        "fedmosaic": {"rounds": fm, "seconds": 2.0},
    }


def test_report_fills_the_marked_tables_of_the_page(report: ModuleType) -> None:
    page = (
        "# t\n<!-- parity:summary -->\nold\n<!-- /parity -->\ntext\n"
        "<!-- parity:run local_dir01_s0 -->\nold\n<!-- /parity -->\n"
    )
    out = report.fill(page, {"local_dir01_s0": _fake_run(0.02)})
    assert "old" not in out and out.startswith("# t\n") and "\ntext\n" in out
    # last 5 rounds (2..6): the gap is +2.00 points in both metrics
    assert "| local | dir01 | 0 | HtFLlib | 6 | fedmosaic | 54.00 | 56.00 | +2.00 / +2.00 |" in out
    assert "| 5 | 55.00 | 57.00 | +2.00 |" in out and "| 6 (final) | 56.00 | 58.00 | +2.00 |" in out
    with pytest.raises(SystemExit, match="other_run"):
        report.fill("<!-- parity:run other_run -->\n<!-- /parity -->", {})


def test_report_seeds_table_pairs_gaps_over_seeds_and_leaves_out_offset_runs(
    report: ModuleType,
) -> None:
    a, b, off = _fake_run(0.02), _fake_run(0.04), _fake_run(0.5)
    b["setup"] = {"seed": 1}
    off["ref_seed_offset"] = 1
    table = report.seeds_table([a, b, off])
    # gaps +2 and +4 points: mean +3, half-width t(1) x sd / sqrt(2) = 12.706 x 1.414 / 1.414
    both = "+2.00, +4.00 | +3.00 [-9.71, +15.71]"
    assert f"| local | dir01 | 6 | HtFLlib | fedmosaic | 0, 1 | {both} | {both} |" in table
    assert "+50.00" not in table and "after fine-tuning" not in table
    # a method that fine-tunes gets a second row from its fine-tuned records (the client mean apart)
    for run, gap in ((a, 0.01), (b, -0.03)):
        run["reference"]["rounds"].append(
            {"round": 6, "finetuned": True, "acc_weighted": 0.8, "acc_mean": 0.7}
        )
        run["fedmosaic"]["rounds"].append(
            {"round": 6, "finetuned": True, "acc_weighted": 0.8 + gap, "acc_mean": 0.7 + 2 * gap}
        )
    table = report.seeds_table([a, b])
    assert f"| local | dir01 | 6 | HtFLlib | fedmosaic | 0, 1 | {both} | {both} |" in table
    # +1 and -3 points: mean -1, half-width 12.706 x 2.828 / 1.414 = 25.41
    assert (
        "| local | dir01 | 6 | HtFLlib | fedmosaic, after fine-tuning | 0, 1 | +1.00, -3.00 | "
        "-1.00 [-26.41, +24.41] | +2.00, -6.00 | -2.00 [-52.82, +48.82] |" in table
    )


def test_report_never_pools_runs_of_another_size_or_read_round(report: ModuleType) -> None:
    a, b, small, short = _fake_run(0.02), _fake_run(0.04), _fake_run(0.5), _fake_run(0.3)
    b["setup"] = {"seed": 1}
    # seed 2 on 10 clients holding 10% of FMNIST: another experiment, not a third seed
    small["setup"] = {"seed": 2, "data": {"num_clients": 10, "subsample": 0.1}}
    short["setup"] = {"seed": 3}  # seed 3 read after 4 rounds, the others after 6
    short["fedmosaic"]["rounds"] = short["fedmosaic"]["rounds"][:4]
    assert report.split_label(a) == "dir01"
    assert report.split_label(small) == "dir01, 10 clients, 10%"
    table = report.seeds_table([a, b, small, short])
    both = "+2.00, +4.00 | +3.00 [-9.71, +15.71]"
    assert f"| local | dir01 | 6 | HtFLlib | fedmosaic | 0, 1 | {both} | {both} |" in table
    assert "+50.00" not in table and "+30.00" not in table  # single runs of their own groups
    pts = report.gap_points([a, b, small])
    assert pts["gaps"] == {
        ("HtFLlib local", "dir01"): [pytest.approx(2.0), pytest.approx(4.0)],
        ("HtFLlib local", "dir01, 10 clients, 10%"): [pytest.approx(50.0)],
    }
    assert "| local | dir01, 10 clients, 10% | 2 | HtFLlib | 6 |" in report.summary([small])


def test_report_gap_points_pair_each_split_and_measure_the_references_own_range(
    tmp_path: Path, report: ModuleType
) -> None:
    a, b, again, off = _fake_run(0.02), _fake_run(-0.01), _fake_run(0.0), _fake_run(0.0)
    b["setup"] = {"seed": 1}
    # the reference on seed 0's split again, 3 points higher, and under shifted torch seeds
    for run in (again, off):
        for r in run["reference"]["rounds"]:
            r["acc_weighted"] += 0.03
    again["ref_seed_globals"] = 0
    off["ref_seed_offset"] = 1
    pts = report.gap_points([a, b, again, off])
    assert pts["gaps"] == {("HtFLlib local", "dir01"): [pytest.approx(2.0), pytest.approx(-1.0)]}
    assert pts["spread"] == {("HtFLlib local", "dir01"): pytest.approx(3.0)}
    report.gap_figure([a, b, again, off], tmp_path / "gaps.png")
    assert (tmp_path / "gaps.png").stat().st_size > 1000


def test_skip_fedmosaic_refuses_a_result_of_another_config(
    harness: ModuleType, tmp_path: Path
) -> None:
    # a result recorded with another fedmosaic config would silently lose its fedmosaic side and
    # variants (they are kept only for the same config): refused before anything runs
    (tmp_path / "fml_dir01_s0.json").write_text(json.dumps({"setup": {"seed": 0}}))
    args = ["fml", "--ref", str(tmp_path / "ref"), "--out", str(tmp_path), "--skip", "fedmosaic"]
    with pytest.raises(SystemExit, match="another fedmosaic config"):
        harness.main([*args, "--skip", "reference"])
    assert json.loads((tmp_path / "fml_dir01_s0.json").read_text()) == {"setup": {"seed": 0}}
    assert not (tmp_path / "ref").exists()  # nothing exported, nothing run


def test_a_corrupt_earlier_result_is_named_not_a_traceback(
    harness: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "fml_dir01_s0.json").write_text('{"setup": ')  # cut off mid-write
    args = ["fml", "--ref", str(tmp_path / "ref"), "--out", str(tmp_path), "--skip", "fedmosaic"]
    with pytest.raises(SystemExit, match="fml_dir01_s0.json: not a readable parity result"):
        harness.main([*args, "--skip", "reference"])
    assert (tmp_path / "fml_dir01_s0.json").read_text() == '{"setup": '


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", "0"], "--clients 0: at least 2 clients"),
        (["--ref-repeat", "-1"], "--ref-repeat -1: >= 0"),
        (["--subsample", "nan"], "--subsample nan: a fraction in (0, 1]"),
        (["--subsample", "1.5"], "--subsample 1.5: a fraction in (0, 1]"),
        (["--rounds", "-1"], "--rounds -1: at least 1"),
        (["--seed", "-5"], "--seed -5: a seed is >= 0"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    harness: ModuleType, tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    ref = tmp_path / "ref"
    (ref / "system").mkdir(parents=True)
    (ref / "system" / "main.py").write_text("")
    with pytest.raises(SystemExit) as info:
        harness.main(["local", "--ref", str(ref), "--out", str(tmp_path / "o"), *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (ref / "dataset").exists()


def test_a_missing_reference_checkout_creates_nothing(
    harness: ModuleType, tmp_path: Path, capsys
) -> None:
    ref, out = tmp_path / "nowhere", tmp_path / "o"
    with pytest.raises(SystemExit) as info:
        harness.main(["local", "--ref", str(ref), "--out", str(out), "--skip", "fedmosaic"])
    assert info.value.code == 2 and "no system/main.py" in capsys.readouterr().err
    assert not ref.exists() and not out.exists()
    afile = tmp_path / "f"
    afile.write_text("x")
    (tmp_path / "r" / "system").mkdir(parents=True)
    (tmp_path / "r" / "system" / "main.py").write_text("")
    with pytest.raises(SystemExit) as info:
        harness.main(["local", "--ref", str(tmp_path / "r"), "--out", str(afile)])
    assert info.value.code == 2 and "a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"setup": "x"}, "setup is a str"),
        ({"setup": {"data": 3}}, "setup.data is not an object"),
        ({"reference": {"command": "python"}}, "reference.command is not a list"),
        ({"variants": []}, "variants is a list"),
    ],
)
def test_a_result_with_wrong_typed_fields_is_named(
    harness: ModuleType, tmp_path: Path, doc: dict, field: str
) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=field):
        harness._read_result(path)


def test_any_split_is_named_by_its_parameters(harness: ModuleType) -> None:
    assert harness.register_setting("dirichlet", 0.5, 2) == "dir05"
    assert harness.SETTINGS["dir05"] == {"partition": "dirichlet", "alpha": 0.5}
    assert harness.register_setting("pathological", 0.1, 3) == "pat3"
    assert harness.register_setting("dirichlet", 0.1, 2) == "dir01"  # the named one, unchanged
    setup = harness.Setup("dir05", 0.05, 10, 5, 1)
    cfg = from_dict(setup.fedmosaic_config({"name": "local"}))
    assert (cfg.data.partition, cfg.data.alpha, cfg.data.num_clients) == ("dirichlet", 0.5, 10)
    # result files: the page's 20 clients at 5% keep their names, others carry theirs
    assert harness.Setup("dir01", 0.05, 20, 40, 0).stem("fedtgp") == "fedtgp_dir01_s0"
    assert setup.stem("local") == "local_dir05_s1_n10"
    assert harness.Setup("dir01", 0.1, 10, 40, 2).stem("fml") == "fml_dir01_s2_n10_f0p1"
    assert harness.Setup(library="pfllib").stem("fedavg") == "pfllib_fedavg_dir01_s0"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--partition", "dirichlet", "--alpha", "0"], "--alpha 0.0: a positive number"),
        (["--partition", "dirichlet", "--alpha", "nan"], "--alpha nan: a positive number"),
        (["--partition", "pathological", "--classes-per-client", "11"], "1 to 10"),
        (["--alpha", "0.5"], "--alpha and --classes-per-client need --partition"),
    ],
)
def test_bad_split_arguments_are_refused(
    harness: ModuleType, tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        harness.main(["local", "--ref", str(tmp_path / "ref"), "--out", str(tmp_path / "o"), *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_fedtgps_code_form_is_a_method_with_its_paper_form_beside_it(harness: ModuleType) -> None:
    code = harness.HTFLLIB["fedtgp_code"]
    assert code.algorithm["lam"] == 10.0 and code.algorithm["distance"] == "mse"
    assert code.ref_args[code.ref_args.index("-lam") + 1] == "10"
    paper = {**code.algorithm, **code.variants["paper_form"]}
    assert (paper["distance"], paper["lam"], paper["stale_prototypes"]) == ("euclidean", 0.1, False)


def test_shim_seeds_the_global_generators_the_references_leave_unseeded() -> None:
    import random

    import numpy as np

    spec = importlib.util.spec_from_file_location("parity_shim3", HARNESS.parent / "launch_shim.py")
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    state = (random.getstate(), np.random.get_state())
    try:
        draws = []
        for _ in range(2):  # HtFLlib's client selection and upload order, twice
            shim.seed_globals(7)
            draws.append(
                (list(np.random.choice(10, 5, replace=False)), random.sample(range(10), 5))
            )
        assert draws[0] == draws[1]
        shim.seed_globals(8)
        assert (list(np.random.choice(10, 5, replace=False)), random.sample(range(10), 5)) != draws[
            0
        ]
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def test_a_globally_seeded_reference_run_is_labelled_and_left_out_of_the_summary(
    report: ModuleType,
) -> None:
    doc = _fake_run(0.0)
    seeds = [doc, {**_fake_run(0.5), "setup": {"seed": 1}}]
    assert report.seeds_table(seeds) != report.seeds_table([])
    seeded = [{**d, "ref_seed_globals": 0} for d in seeds]
    assert report.seeds_table(seeded) == report.seeds_table([])
    assert report._ref_name(doc) == "HtFLlib"
    assert report._ref_name({**doc, "ref_seed_globals": 0}) == "HtFLlib (numpy and random seeded 0)"
    both = {**doc, "ref_seed_offset": 1, "ref_seed_globals": 3}
    assert report._ref_name(both) == "HtFLlib (torch seeds +1, numpy and random seeded 3)"
    # --ref-repeat: the reference again on identical inputs, its spread and not a parity gap
    again = {**_fake_run(0.5), "ref_repeat": 1}
    assert report._ref_name(again) == "HtFLlib (again, run 2)"
    assert report.seeds_table([*seeds, again]) == report.seeds_table(seeds)
    pts = report.gap_points([doc, again])
    assert pts["gaps"] == {("HtFLlib local", "dir01"): [pytest.approx(0.0)]}


def test_report_spread_table_sets_each_repeat_beside_the_run_it_repeats(report: ModuleType) -> None:
    base, again, same = _fake_run(0.0), _fake_run(0.0), _fake_run(0.0)
    again["ref_repeat"] = 1
    for r in again["reference"]["rounds"][3:]:  # parts after round 2, by 0.5 to 2 points
        r["acc_weighted"] += 0.005 * (r["round"] - 3) + 0.005
    same["ref_repeat"] = 1
    table = report.spread_table({"local_dir01_s0": base, "local_dir01_s0_u1": again})
    (row,) = table.splitlines()[2:]
    # last 5 rounds 2..6: 0.52..0.56 -> mean 54.00; again + (0 + .5 + 1 + 1.5 + 2) / 5 points
    assert row == "| HtFLlib local | dir01 | 0 | 1 / 2 | 2 | 2.00 | 54.00 / 55.00 |"
    table = report.spread_table({"local_dir01_s0": base, "local_dir01_s0_u1": same})
    assert "| 1 / 2 | 6 (every round) | 0.00 |" in table
    third = dict(same, ref_repeat=2)  # a third run: every two of the three side by side
    table = report.spread_table(
        {"local_dir01_s0": base, "local_dir01_s0_u1": again, "local_dir01_s0_u2": third}
    )
    assert [r.split(" | ")[3] for r in table.splitlines()[2:]] == ["1 / 2", "1 / 3", "2 / 3"]
    assert "| 1 / 3 | 6 (every round) |" in table and "| 2 / 3 | 2 | 2.00 |" in table
    # a repeat without the run it repeats is left out, and no repeat at all says so
    assert report.spread_table({"local_dir01_s0_u1": again}) == "(no repeated reference runs)"
    page = "<!-- parity:spread -->\nold\n<!-- /parity -->\n"
    assert "54.00 / 55.00" in report.fill(
        page, {"local_dir01_s0": base, "local_dir01_s0_u1": again}
    )


def test_grad_norm_probe_counts_every_step_of_each_group(harness: ModuleType) -> None:
    spec = importlib.util.spec_from_file_location("parity_grad_norms", GRAD_NORMS)
    assert spec is not None and spec.loader is not None
    probe_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_mod)
    doc = harness.Setup(num_clients=2, rounds=1).fedmosaic_config({"name": "fml"})
    doc["data"].update(
        dataset="synthetic", synthetic_size=60, synthetic_classes=10, synthetic_shape=[1, 28, 28]
    )
    doc["data"].pop("subsample")
    cfg = from_dict(doc)
    low = probe_mod.probe(cfg, 2, 1e-12)
    high = probe_mod.probe(cfg, 2, 1e12)
    assert set(low) == {"model", "meme"}  # the client's model and FML's meme, apart
    fed_steps = low["model"]["steps"]
    assert fed_steps > 0 and low["meme"]["steps"] == fed_steps
    for group in low:
        assert low[group]["over"] == fed_steps and high[group]["over"] == 0
        assert low[group]["max"] == high[group]["max"] > 0  # the same steps, run again
    # a loss that its before_fit prepares is refused, not probed half-built
    tgp = from_dict({**doc, "algorithm": {"name": "fedtgp"}})
    with pytest.raises(SystemExit, match="before_fit"):
        probe_mod.probe(tgp, 1, 10.0)
