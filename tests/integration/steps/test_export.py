"""`ctrflow export`: a complete, parseable, validated Triton repository whose ensemble chain,
run offline through its own model.py files, scores raw rows exactly as `ctrflow predict`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.fixtures.serving import checkpoint, load_python_model, movielens_data, processed_data, raw_requests
from tritonclient.grpc import model_config_pb2 as pb

from ctrflow.errors import UserError
from ctrflow.export import export
from ctrflow.export.triton import read_config
from ctrflow.export.validate import check_repository
from ctrflow.predict import predict

pytestmark = pytest.mark.integration

ROWS = slice(0, 50)  # first 50 lines of the validation day
BACKENDS = ("onnxruntime", "pytorch", "python")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One repository per backend, plus `ctrflow predict` on the same raw rows."""
    raw, data = processed_data(tmp_path_factory)
    ckpt = checkpoint(tmp_path_factory)
    root = tmp_path_factory.mktemp("export")
    lines = (raw / "day_1.tsv").read_bytes().split(b"\n")[ROWS]
    (root / "rows.tsv").write_bytes(b"\n".join(lines) + b"\n")
    predict(ckpt, data, [root / "rows.tsv"], root / "scores.parquet")
    summaries = {backend: export(ckpt, data, root / f"repo-{backend}", "ctr", backend=backend,
                                 max_batch_size=64, validation_rows=300) for backend in BACKENDS}
    import pyarrow.parquet as pq

    expected = pq.read_table(root / "scores.parquet").column("probability").to_numpy()
    return {"root": root, "raw": raw, "data": data, "summaries": summaries, "expected": expected}


def test_repository_configs_parse_with_tritons_protobuf(exported):
    repo = exported["root"] / "repo-onnxruntime"
    configs = check_repository(repo, "ctr")
    ensemble, pre, rank = configs["ctr"], configs["ctr_preprocess"], configs["ctr_model"]
    assert ensemble.platform == "ensemble" and ensemble.max_batch_size == 64
    assert [i.name for i in ensemble.input][:2] == ["I1", "I2"] and len(ensemble.input) == 39
    assert all(i.data_type == pb.TYPE_STRING and list(i.dims) == [1] for i in ensemble.input)
    assert [(o.name, o.data_type) for o in ensemble.output] == [("probability", pb.TYPE_FP32)]
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["ctr_preprocess", "ctr_model"]
    assert pre.backend == "python" and pre.HasField("dynamic_batching")
    assert rank.backend == "onnxruntime" and rank.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    assert (repo / "ctr_model" / "1" / "model.onnx").exists()
    assert (repo / "ctr_preprocess" / "1" / "vocab" / "C1.parquet").exists()
    assert "numpy" in (repo / "requirements.txt").read_text()
    assert read_config(repo / "ctr" / "config.pbtxt") == ensemble


def test_pytorch_backend_binds_torchscript_arguments_by_index(exported):
    repo = exported["root"] / "repo-pytorch"
    configs = check_repository(repo, "ctr")
    rank, step = configs["ctr_model"], configs["ctr"].ensemble_scheduling.step[1]
    assert rank.platform == "pytorch_libtorch" and rank.backend == "pytorch"
    assert rank.default_model_filename == "model.pt" and (repo / "ctr_model" / "1" / "model.pt").exists()
    assert [(i.name, i.data_type) for i in rank.input] == [("dense__0", pb.TYPE_FP32), ("sparse__1", pb.TYPE_INT64)]
    assert [o.name for o in rank.output] == ["probability__0"]
    assert dict(step.input_map) == {"dense__0": "dense", "sparse__1": "sparse"}
    assert dict(step.output_map) == {"probability__0": "probability"}
    from ctrflow.export.torchscript import load_torchscript

    graph = str(load_torchscript(repo / "ctr_model" / "1" / "model.pt").inlined_graph)
    assert "cpu" not in graph and "cuda" not in graph  # no device baked in: Triton may place it on a GPU
    assert "torch" not in (repo / "requirements.txt").read_text()  # libtorch serves it: no python deps


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_matches_trained_model(exported, backend):
    report = json.loads((exported["root"] / f"repo-{backend}" / "validation.json").read_text())
    assert report["rows"] == 300
    assert report["max_abs_diff"] <= 1e-5
    assert exported["summaries"][backend]["max_abs_diff"] == report["max_abs_diff"]


def _torchscript(repo, features, name="ctr"):
    """What the libtorch backend does: the ensemble's tensors -> forward's arguments by the
    `__<index>` of the config's names."""
    import torch

    from ctrflow.export.torchscript import load_torchscript

    configs = check_repository(repo, name)
    order = sorted(configs[f"{name}_model"].input, key=lambda i: int(i.name.rsplit("__", 1)[1]))
    step = configs[name].ensemble_scheduling.step[1]
    module = load_torchscript(repo / f"{name}_model" / "1" / "model.pt")
    with torch.inference_mode():
        return [module(*[torch.from_numpy(r.output(step.input_map[i.name])) for i in order]).numpy()
                for r in features]


def _chain(monkeypatch, repo, requests, name="ctr"):
    """NAME_preprocess -> NAME_model as Triton's ensemble runs them, one response per request: the
    preprocessing step's outputs go to the ranking model by the ensemble config's maps."""
    from tests.fixtures.serving import FakeRequest

    pre = load_python_model(monkeypatch, repo / f"{name}_preprocess" / "1" / "model.py")
    features = pre.execute(requests)
    assert all(r.error is None for r in features)
    if (repo / f"{name}_model" / "1" / "model.pt").exists():
        return _torchscript(repo, features, name)
    tensors = [{t.name(): t.as_numpy() for t in r.output_tensors} for r in features]
    if (repo / f"{name}_model" / "1" / "model.onnx").exists():
        import onnxruntime as ort

        session = ort.InferenceSession(str(repo / f"{name}_model" / "1" / "model.onnx"))
        return [session.run(None, given)[0] for given in tensors]
    model = load_python_model(monkeypatch, repo / f"{name}_model" / "1" / "model.py")
    ranked = model.execute([FakeRequest(given) for given in tensors])
    assert all(r.error is None for r in ranked)
    return [r.output("probability") for r in ranked]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ensemble_chain_on_raw_rows_equals_predict(exported, monkeypatch, backend):
    from tests.fixtures.serving import FakeRequest

    fields = raw_requests(exported["raw"] / "day_1.tsv", exported["data"], ROWS)
    halves = [FakeRequest({k: v[:20] for k, v in fields.items()}), FakeRequest({k: v[20:] for k, v in fields.items()})]
    outputs = _chain(monkeypatch, exported["root"] / f"repo-{backend}", halves)
    got = np.concatenate(outputs)
    assert got.shape == (50, 1) and got.dtype == np.float32
    assert np.abs(got[:, 0] - exported["expected"]).max() <= 1e-5
    assert exported["expected"].std() > 1e-3  # the rows really score differently


def test_malformed_field_gets_error_response_naming_it(exported, monkeypatch):
    from tests.fixtures.serving import FakeRequest

    repo = exported["root"] / "repo-python"
    pre = load_python_model(monkeypatch, repo / "ctr_preprocess" / "1" / "model.py")
    fields = raw_requests(exported["raw"] / "day_1.tsv", exported["data"], slice(0, 3))
    bad = dict(fields, I5=np.array([[b"12"], [b"x7"], [b""]], dtype=object))
    missing = {k: v for k, v in fields.items() if k != "C9"}
    responses = pre.execute([FakeRequest(bad), FakeRequest(missing), FakeRequest(fields)])
    assert "I5" in responses[0].error.message()
    assert "C9" in responses[1].error.message()
    assert responses[2].error is None and responses[2].output("dense").shape == (3, 13)
    model = load_python_model(monkeypatch, repo / "ctr_model" / "1" / "model.py")
    out_of_range = np.full((1, 26), 10**9, dtype=np.int64)
    ranked = model.execute([FakeRequest({"dense": np.zeros((1, 13), np.float32), "sparse": out_of_range})])
    assert "C1" in ranked[0].error.message()


def test_checkpoint_from_other_data_is_refused(exported, tmp_path, tmp_path_factory):
    import shutil

    from ctrflow.contract.criteo import criteo_features
    from ctrflow.contract.schema import Schema

    other = tmp_path / "other"
    shutil.copytree(exported["data"], other)
    schema = Schema.load(other)
    cards = dict(schema.cardinalities, C3=schema.cardinalities["C3"] + 5)
    Schema(cardinalities=cards, features=criteo_features(cards), freq_threshold=schema.freq_threshold, rows=schema.rows,
           vocab_hash="0" * 64).save(other / "schema.json")
    with pytest.raises(UserError, match="C3 cardinality"):
        export(checkpoint(tmp_path_factory), other, tmp_path / "repo", "ctr")


def test_failed_validation_leaves_repository_untouched(exported, tmp_path, tmp_path_factory, monkeypatch):
    import ctrflow.export.validate as validate

    monkeypatch.setattr(validate, "TOLERANCE", -1.0)  # no export can pass: stands for a broken exporter
    repo = tmp_path / "repo"
    with pytest.raises(UserError, match="differs from the trained one"):
        export(checkpoint(tmp_path_factory), exported["data"], repo, "ctr", backend="python", validation_rows=10)
    assert not repo.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind


def test_broken_config_is_reported_with_its_path(exported, tmp_path):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(exported["root"] / "repo-python", repo)
    (repo / "ctr_model" / "config.pbtxt").write_text('name: "ctr_model"\nmax_batch_size: "many"\n')
    with pytest.raises(UserError, match=r"ctr_model/config.pbtxt: not a valid Triton model config"):
        check_repository(repo, "ctr")
    shutil.rmtree(repo / "ctr_preprocess" / "1" / "vocab")
    (repo / "ctr_model" / "config.pbtxt").write_text(
        (exported["root"] / "repo-python" / "ctr_model" / "config.pbtxt").read_text())
    with pytest.raises(UserError, match=r"missing .*ctr_preprocess/1/vocab"):
        check_repository(repo, "ctr")


def test_metrics_auc_is_read_and_bad_metrics_are_refused(exported, tmp_path, tmp_path_factory):
    from ctrflow.export import read_auc

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "metrics.json").write_text(json.dumps({"auc": 0.7125, "logloss": 0.5, "rows": 600}))
    assert read_auc(tmp_path / "eval") == read_auc(tmp_path / "eval" / "metrics.json") == 0.7125
    (tmp_path / "nan.json").write_text('{"auc": null, "rows": 0}')
    with pytest.raises(UserError, match=r"nan.json: field auc"):
        read_auc(tmp_path / "nan.json")
    with pytest.raises(UserError, match=r"missing.json: not a readable metrics.json"):
        export(checkpoint(tmp_path_factory), exported["data"], tmp_path / "repo", "ctr",
               metrics=tmp_path / "missing.json")
    assert not (tmp_path / "repo").exists()  # refused before anything was written


def test_serve_refuses_backends_the_bundled_tritonserver_lacks(exported, capsys):
    from ctrflow.cli import main
    from ctrflow.commands.serve import check_servable

    assert sorted(check_servable(exported["root"] / "repo-python")) == ["ctr", "ctr_model", "ctr_preprocess"]
    for backend in ("onnxruntime", "pytorch"):
        assert main(["serve", "--repo", str(exported["root"] / f"repo-{backend}")]) == 2
        error = capsys.readouterr().err
        assert f"ctr_model/config.pbtxt: backend {backend} is not in the bundled tritonserver" in error


# --- a dataset of its own: the movielens-like table (multi-hot genres), and one without dense columns ---

def test_inputs_are_the_feature_columns_and_zero_width_tensors_are_left_out():
    from ctrflow.contract.features import Feature, Features
    from ctrflow.serve import model_inputs, raw_inputs

    def features(dense=("price",), categorical=("userId",), multi_hot=("genres",)) -> Features:
        return Features(dense=tuple(Feature(n, "dense", transform="log1p") for n in dense),
                        sparse=tuple([Feature(n, "categorical", cardinality=10) for n in categorical]
                                     + [Feature(n, "multi_hot", cardinality=10, max_length=3, pooling="sum")
                                        for n in multi_hot]))

    assert raw_inputs(features()) == ("price", "userId", "genres")
    assert model_inputs(features()) == ("dense", "sparse")
    assert model_inputs(features(dense=())) == ("sparse",)
    assert model_inputs(features(categorical=(), multi_hot=())) == ("dense",)


@pytest.fixture(scope="module", params=["movielens", "movielens-no-dense"])
def movies(request, tmp_path_factory):
    """Repositories of every backend for a DeepFM on movielens-like data, and `ctrflow predict` on
    the raw CSV rows they are asked about."""
    import pyarrow.parquet as pq

    raw, data = movielens_data(tmp_path_factory, drop=("dense",) if request.param.endswith("no-dense") else ())
    ckpt = checkpoint(tmp_path_factory, "deepfm", data)
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    lines = (raw / "day_1.csv").read_text().splitlines()[:61]  # the header and 60 rows
    (root / "rows.csv").write_text("\n".join(lines) + "\n")
    predict(ckpt, data, [root / "rows.csv"], root / "scores.parquet")
    for backend in BACKENDS:
        export(ckpt, data, root / f"repo-{backend}", "movies", backend=backend, max_batch_size=64,
               validation_rows=300)
    return {"root": root, "data": data, "dense": not request.param.endswith("no-dense"),
            "expected": pq.read_table(root / "scores.parquet").column("probability").to_numpy()}


def test_ensemble_inputs_are_the_descriptions_columns(movies):
    configs = check_repository(movies["root"] / "repo-pytorch", "movies")
    ensemble, pre, rank = configs["movies"], configs["movies_preprocess"], configs["movies_model"]
    columns = ["age", "price"] if movies["dense"] else []
    assert [i.name for i in ensemble.input] == [*columns, "userId", "movieId", "genres"]  # no timestamp, no label
    assert all(i.data_type == pb.TYPE_STRING and list(i.dims) == [1] for i in ensemble.input)
    widths = [("dense", pb.TYPE_FP32, [2])] if movies["dense"] else []  # Triton refuses a zero-width tensor
    widths.append(("sparse", pb.TYPE_INT64, [1 + 1 + 4]))  # userId, movieId, 4 genre slots
    assert [(o.name, o.data_type, list(o.dims)) for o in pre.output] == widths
    assert [i.name for i in rank.input] == [f"{name}__{k}" for k, (name, _, _) in enumerate(widths)]
    assert dict(ensemble.ensemble_scheduling.step[0].output_map) == {name: name for name, _, _ in widths}
    assert (movies["root"] / "repo-pytorch" / "movies_preprocess" / "1" / "vocab" / "genres.parquet").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_movielens_chain_on_raw_csv_rows_equals_predict(movies, monkeypatch, backend):
    from tests.fixtures.serving import FakeRequest

    report = json.loads((movies["root"] / f"repo-{backend}" / "validation.json").read_text())
    assert report["max_abs_diff"] <= 1e-5 and report["rows"] == 300
    fields = raw_requests(movies["root"] / "rows.csv", movies["data"], slice(0, 60))
    assert set(fields) >= {"userId", "movieId", "genres"} and b"|" in b"".join(fields["genres"][:, 0])
    halves = [FakeRequest({k: v[:25] for k, v in fields.items()}), FakeRequest({k: v[25:] for k, v in fields.items()})]
    got = np.concatenate(_chain(monkeypatch, movies["root"] / f"repo-{backend}", halves, "movies"))
    assert got.shape == (60, 1)
    assert np.abs(got[:, 0] - movies["expected"]).max() <= 1e-5
    assert movies["expected"].std() > 1e-3
