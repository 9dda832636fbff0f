"""NVTabular/Merlin `schema.pbtxt`: parses as the Merlin (tensorflow_metadata) schema proto."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from ctrflow.contract.criteo import DENSE, SPARSE
from tests.fixtures.preprocess import random_rows, write

_FIELDS = {  # the subset of tensorflow_metadata's schema.proto that Merlin writes for tabular columns
    "Schema": [("feature", 1, "Feature", "repeated")],
    "Feature": [("name", 1, "string", "optional"), ("type", 6, "FeatureType", "optional"),
                ("int_domain", 9, "IntDomain", "optional"), ("annotation", 15, "Annotation", "optional"),
                ("value_count", 5, "ValueCount", "optional")],
    "ValueCount": [("min", 1, "int64", "optional"), ("max", 2, "int64", "optional")],
    "IntDomain": [("name", 1, "string", "optional"), ("min", 3, "int64", "optional"),
                  ("max", 4, "int64", "optional"), ("is_categorical", 5, "bool", "optional")],
    "Annotation": [("tag", 1, "string", "repeated")],
}


def _schema_class():
    proto = descriptor_pb2.FileDescriptorProto(name="merlin_subset.proto", package="tensorflow.metadata.v0")
    enum = proto.enum_type.add(name="FeatureType")
    for number, name in enumerate(["TYPE_UNKNOWN", "BYTES", "INT", "FLOAT", "STRUCT"]):
        enum.value.add(name=name, number=number)
    scalar = {"string": 9, "int64": 3, "bool": 8}
    for message, fields in _FIELDS.items():
        described = proto.message_type.add(name=message)
        for name, number, kind, label in fields:
            field = described.field.add(name=name, number=number, label=3 if label == "repeated" else 1)
            if kind in scalar:
                field.type = scalar[kind]
            else:
                field.type = 14 if kind == "FeatureType" else 11
                field.type_name = f".tensorflow.metadata.v0.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.metadata.v0.Schema"))


def test_schema_pbtxt_describes_columns_for_nvtabular(tmp_path):
    out = tmp_path / "out"
    preprocess([write(tmp_path / "in.tsv", random_rows(300, seed=2))], out=out, freq_threshold=2, workers=1)
    parsed = text_format.Parse((out / "schema.pbtxt").read_text(), _schema_class()())
    features = {f.name: f for f in parsed.feature}
    assert list(features) == ["label", *DENSE, *SPARSE]
    cardinalities = Schema.load(out).cardinalities
    for name in SPARSE:  # Merlin's embedding size is max + 1: our cardinality
        domain = features[name].int_domain
        assert (domain.min, domain.max + 1, domain.is_categorical) == (0, cardinalities[name], True)
        assert list(features[name].annotation.tag) == ["categorical"]
    assert list(features["I3"].annotation.tag) == ["continuous"] and features["I3"].type == 3
    assert "target" in features["label"].annotation.tag
    assert not list((out / "train").glob("*.pbtxt"))  # pyarrow reads every non-"_" file of a split directory


def test_schema_pbtxt_and_hugectr_metadata_describe_a_multi_hot_table(tmp_path):
    import json

    from tests.fixtures.tables import movie_rows, write_csv, write_description

    out = tmp_path / "out"
    preprocess([write_csv(tmp_path / "m.csv", movie_rows(200))], out=out, workers=1,
               dataset=write_description(tmp_path / "m.yaml"))
    parsed = text_format.Parse((out / "schema.pbtxt").read_text(), _schema_class()())
    features = {f.name: f for f in parsed.feature}
    assert list(features) == ["label", "year", "price", "userId", "movieId", "genres"]
    genres = features["genres"]
    assert (genres.value_count.min, genres.value_count.max) == (3, 3)
    assert list(genres.annotation.tag) == ["categorical", "list"]
    assert genres.int_domain.max + 1 == Schema.load(out).cardinalities["genres"]
    metadata = json.loads((out / "train" / "_metadata.json").read_text())
    assert [c["col_name"] for c in metadata["cats"]] == ["userId", "movieId", "genres"]
    assert [c["col_name"] for c in metadata["conts"]] == ["year", "price"]
