import pytest
from helpers.experiments import tiny_raw

from fedmosaic.config import ConfigError, apply_overrides, from_dict, load, parse_value


def test_defaults_load():
    cfg = from_dict(tiny_raw())
    assert cfg.data.dataset == "synthetic" and cfg.train.rounds == 2


def test_unknown_key_named():
    with pytest.raises(ConfigError, match="'data.alpah'"):
        from_dict(tiny_raw(data={"alpah": 0.5}))
    with pytest.raises(ConfigError, match="'bogus'"):
        from_dict({**tiny_raw(), "bogus": 1})


def test_wrong_type_named():
    with pytest.raises(ConfigError, match="train.rounds"):
        from_dict(tiny_raw(train={"rounds": "ten"}))
    with pytest.raises(ConfigError, match="data.alpha"):
        from_dict(tiny_raw(data={"alpha": True}))


def test_bad_choice_and_range():
    with pytest.raises(ConfigError, match="data.partition"):
        from_dict(tiny_raw(data={"partition": "zipf"}))
    with pytest.raises(ConfigError, match="train.participation"):
        from_dict(tiny_raw(train={"participation": 0.0}))


def test_algorithm_errors_named():
    with pytest.raises(ConfigError, match="algorithm.name = 'fedavgg'"):
        from_dict(tiny_raw(algorithm={"name": "fedavgg"}))
    with pytest.raises(ConfigError, match="algorithm.muu"):
        from_dict(tiny_raw(algorithm={"name": "fedprox", "muu": 0.1}))
    with pytest.raises(ConfigError, match="algorithm.mu"):
        from_dict(tiny_raw(algorithm={"name": "fedprox", "mu": "big"}))


def test_homogeneous_method_rejects_heterogeneous_family():
    with pytest.raises(ConfigError, match="model.family = 'htfe8-gray' is heterogeneous"):
        from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedavg"}))
    from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "lg_fedavg"}))


def test_unknown_family_named():
    with pytest.raises(ConfigError, match="model.family"):
        from_dict(tiny_raw(model={"family": "resnet999"}))


def test_overrides_parse_values(tmp_path):
    assert parse_value("0.5") == 0.5 and parse_value("true") is True and parse_value("abc") == "abc"
    assert parse_value("[1, 2]") == [1, 2]
    raw = apply_overrides({}, ["data.alpha=0.5", "algorithm.name=local"])
    assert raw == {"data": {"alpha": 0.5}, "algorithm": {"name": "local"}}
    path = tmp_path / "c.toml"
    path.write_text('seed = 3\n[data]\ndataset = "synthetic"\n[model]\nfamily = "cnn1"\n')
    cfg = load(path, ["train.rounds=7", "algorithm.name=local"])
    assert (cfg.seed, cfg.train.rounds, cfg.algorithm["name"]) == (3, 7, "local")
    with pytest.raises(ConfigError, match="section.key=value"):
        load(path, ["rounds"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[data\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad)


def test_synthetic_size_is_capped_by_the_memory_its_generation_needs():
    from fedmosaic.config import MAX_SYNTHETIC_BYTES, synthetic_memory

    shape = [1, 28, 28]
    with pytest.raises(
        ConfigError, match=r"data\.synthetic_size = 3000000 .* largest accepted"
    ) as e:
        from_dict(tiny_raw(data={"synthetic_size": 3_000_000, "synthetic_shape": shape}))
    largest = int(str(e.value).rsplit(" ", 1)[1])
    assert synthetic_memory(largest, 4, shape) <= MAX_SYNTHETIC_BYTES
    assert synthetic_memory(largest + 1, 4, shape) > MAX_SYNTHETIC_BYTES
    from_dict(tiny_raw(data={"synthetic_size": largest, "synthetic_shape": shape}))
    with pytest.raises(ConfigError, match=f"largest accepted size here is {largest}"):
        from_dict(tiny_raw(data={"synthetic_size": largest + 1, "synthetic_shape": shape}))
    # One huge image: the generator's working set is one image, counted too.
    with pytest.raises(ConfigError, match="largest accepted size here is 0"):
        from_dict(tiny_raw(data={"synthetic_size": 10, "synthetic_shape": [1, 10000, 10000]}))
