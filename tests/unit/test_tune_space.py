"""The search space file: config fields by leaf name or dotted path, ranges and choices, bad entries."""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")

from ctrflow.errors import UserError  # noqa: E402
from ctrflow.tune.space import parse_space, read_space, resolve_key  # noqa: E402


def test_leaf_names_and_dotted_paths_resolve_to_config_fields():
    space = parse_space({"lr": {"low": 0.0003, "high": 0.01, "log": True},
                         "optim.sparse_lr": {"low": 0.001, "high": 0.1, "log": True},
                         "embedding_dim": {"choices": [8, 16, 32]},
                         "deep_mlp": {"choices": [[128, 64], [256, 128]]},
                         "dense": {"choices": ["adam", "adamw"]},
                         "batch_size": {"low": 512, "high": 4096, "step": 512},
                         "freq_threshold": {"low": 6, "high": 20}}, "space.yaml")
    assert [p.key for p in space.params] == ["optim.lr", "optim.sparse_lr", "model.embedding_dim",
                                             "model.deep_mlp", "optim.dense", "data.batch_size", "freq_threshold"]
    kinds = {p.key: p.kind for p in space.params}
    assert kinds["optim.lr"] == "float" and kinds["data.batch_size"] == "int" and kinds["freq_threshold"] == "int"
    assert space.params[3].choices == ((128, 64), (256, 128))  # widths become tuples, as config files make them


def test_a_float_field_ranges_over_floats_even_when_written_with_integers():
    (param,) = parse_space({"dropout": {"low": 0, "high": 1}}, "s.yaml").params
    assert param.kind == "float"
    assert isinstance(param.distribution(), optuna.distributions.FloatDistribution)


def test_width_choices_round_trip_through_optuna_strings():
    space = parse_space({"top_mlp": {"choices": [[64, 32], [128, 64, 32]]}}, "s.yaml")
    dist = space.distributions["model.top_mlp"]
    assert dist.choices == ("64,32", "128,64,32")
    assert space.values({"model.top_mlp": "128,64,32"}) == {"model.top_mlp": (128, 64, 32)}


def test_sampled_values_come_from_the_distributions():
    space = parse_space({"lr": {"low": 0.001, "high": 0.01, "log": True}, "embedding_dim": {"choices": [8, 16]},
                         "batch_size": {"low": 256, "high": 1024, "step": 256}}, "s.yaml")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        values = space.values(study.ask(space.distributions).params)
        assert 0.001 <= values["optim.lr"] <= 0.01
        assert values["model.embedding_dim"] in (8, 16)
        assert values["data.batch_size"] in (256, 512, 768, 1024)


@pytest.mark.parametrize("raw, message", [
    ({"learning_rate": {"low": 0.1, "high": 1}}, "unknown field 'learning_rate'"),
    ({"lr": {"low": 0.1, "high": 0.01}}, "empty range: low 0.1 > high 0.01"),
    ({"dropout": {"choices": []}}, "choices must be a non-empty list"),
    ({"embedding_dim": {"low": 8.5, "high": 32}}, "low must be an integer"),
    ({"dense": {"choices": ["adam", "lion"]}}, "optim.dense must be one of adam, adamw, sgd, got 'lion'"),
    ({"lr": {"low": 0, "high": 0.1, "log": True}}, "a log range needs low > 0"),
    ({"lr": {"low": 0.1}}, "a range is {low, high"),
    ({"lr": 0.1}, "expected {low: ..., high: ...} or {choices: [...]}"),
    ({"out": {"choices": ["a", "b"]}}, "out is set by ctrflow tune itself"),
    ({"freq_threshold": {"low": 0, "high": 5}}, "thresholds are at least 1"),
    ({"lr": {"low": 0.1, "high": 1}, "optim.lr": {"low": 0.1, "high": 1}}, "name the same field optim.lr"),
    ({"name": {"low": 1, "high": 2}}, "takes no numbers from a range"),
    ({}, "a search space is a mapping"),
])
def test_bad_entries_are_one_line_errors_naming_the_file_and_key(raw, message):
    with pytest.raises(UserError, match=None) as err:
        parse_space(raw, "space.yaml")
    text = str(err.value)
    assert message in text and text.startswith("space.yaml") and "\n" not in text


def test_an_ambiguous_leaf_name_asks_for_the_dotted_path():
    with pytest.raises(UserError, match="'lr' is ambiguous: write one of optim.lr, other.lr"):
        resolve_key("lr", {"optim.lr": float, "other.lr": float}, "space.yaml")


def test_yaml_errors_name_the_line(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("lr: {low: 0.1, high: 1\n")
    with pytest.raises(UserError, match=r"space.yaml: line \d+, column \d+"):
        read_space(path)
    with pytest.raises(UserError, match="no such file"):
        read_space(tmp_path / "missing.yaml")
