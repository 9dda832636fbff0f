"""`ctrflow train --report-metrics`: the files and lines Vertex AI and Katib read, parsed as they parse them."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime

import pytest

from ctrflow.cli import main
from ctrflow.errors import UserError
from ctrflow.tune.report import KatibReporter, Reporters, VertexReporter, reporters_for
from tests.fixtures.training import write_processed

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

# Katib's StdOut collector: the default filter now, and the one before exponents were allowed
KATIB_FILTERS = (r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)", r"([\w|-]+)\s*=\s*((-?\d+)(\.\d+)?)")


def katib_collect(text: str, metrics: list[str], metric_filter: str) -> list[tuple[str, str, str]]:
    """(timestamp, name, value) as Katib's text-format collector reads stdout: lines holding a metric
    name, a leading RFC 3339 timestamp if it parses, every filter match whose name is a metric."""
    found = []
    for line in text.split("\n"):
        if not any(m in line for m in metrics):
            continue
        first, _, _ = line.partition(" ")
        try:
            datetime.fromisoformat(first.replace("Z", "+00:00"))
            stamp = first
        except ValueError:
            stamp = "0001-01-01T00:00:00Z"
        for match in re.finditer(metric_filter, line):
            name, value = match.group(1).strip(), match.group(2).strip()
            if name in metrics:
                found.append((stamp, name, value))
    return found


@pytest.mark.parametrize("metric_filter", KATIB_FILTERS)
def test_katib_reads_every_metric_of_a_report(metric_filter):
    out = io.StringIO()
    reporter = KatibReporter(out)
    reporter.report(400, 1, {"auc": 0.78123456, "logloss": 0.4521, "rows": 1000})
    reporter.report(800, 2, {"auc": 0.79, "logloss": float("nan"), "rows": 1000})
    found = katib_collect(out.getvalue(), ["auc", "logloss", "epoch", "step"], metric_filter)
    values = [(name, float(value)) for _, name, value in found]
    assert values == [("epoch", 1), ("step", 400), ("auc", 0.781235), ("logloss", 0.4521),
                      ("epoch", 2), ("step", 800), ("auc", 0.79)]  # a NaN is left out, not read as ""
    assert all(stamp != "0001-01-01T00:00:00Z" for stamp, _, _ in found)


def test_vertex_file_is_what_cloudml_hypertune_writes(tmp_path, monkeypatch):
    path = tmp_path / "hypertune" / "output.metrics"
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(path))
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "12")
    reporter = VertexReporter()
    for step in range(1, 106):
        reporter.report(step * 10, 0, {"auc": 0.5 + step / 1000, "logloss": 0.6})
    lines = path.read_text().splitlines()
    assert len(lines) == 100  # the newest 100, as the package keeps
    entry = json.loads(lines[-1])
    assert list(entry) == sorted(entry)  # json.dumps(..., sort_keys=True)
    assert {k: v for k, v in entry.items() if k != "timestamp"} == {
        "auc": str(0.5 + 105 / 1000), "checkpoint_path": "", "global_step": "1050", "trial": "12"}
    assert isinstance(entry["timestamp"], float)
    assert json.loads(lines[0])["global_step"] == "60"
    assert lines[-1] == json.dumps(entry, sort_keys=True)


def test_vertex_defaults_and_step_zero(tmp_path):
    reporter = VertexReporter(path=tmp_path / "m")
    reporter.report(0, 0, {"auc": 0.7})
    assert json.loads((tmp_path / "m").read_text()) | {"timestamp": 0} == {
        "auc": "0.7", "checkpoint_path": "", "global_step": "0", "trial": "0", "timestamp": 0}


def test_reporters_by_name():
    assert isinstance(reporters_for(["vertex"]), VertexReporter)
    both = reporters_for(["katib,vertex", "none", "katib"])
    assert isinstance(both, Reporters) and [type(r) for r in both.reporters] == [KatibReporter, VertexReporter]
    assert type(reporters_for(None)).__name__ == "Reporters" and not reporters_for(["none"]).reporters
    with pytest.raises(UserError, match="'wandb' is not one of vertex, katib, none"):
        reporters_for(["wandb"])


def test_train_reports_each_validation_to_both_services(tmp_path, monkeypatch, capsys):
    data = write_processed(tmp_path / "data", train_rows=2048, valid_rows=1024, cardinality=20)
    monkeypatch.setenv("CLOUD_ML_HP_METRIC_FILE", str(tmp_path / "hpt" / "output.metrics"))
    monkeypatch.setenv("CLOUD_ML_TRIAL_ID", "3")
    out = tmp_path / "ckpt"
    code = main(["train", "--data", str(data), "--out", str(out), "--batch-size", "256", "--eval-every", "3",
                 "--no-progress", "--tracking-uri", "none", "--report-metrics", "vertex,katib"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validations = [(r["step"], r["auc"]) for r in records if "auc" in r]
    assert [s for s, _ in validations] == [3, 6, 8]  # every 3 steps and the epoch's end
    katib = katib_collect(capsys.readouterr().out, ["auc", "step"], KATIB_FILTERS[0])
    assert [float(v) for _, n, v in katib if n == "step"] == [3, 6, 8]
    assert [float(v) for _, n, v in katib if n == "auc"] == pytest.approx([a for _, a in validations], abs=1e-6)
    vertex = [json.loads(line) for line in (tmp_path / "hpt" / "output.metrics").read_text().splitlines()]
    assert [(int(e["global_step"]), float(e["auc"]), e["trial"]) for e in vertex] == \
        [(s, a, "3") for s, a in validations]


def test_train_refuses_an_unknown_service(tmp_path, capsys):
    data = write_processed(tmp_path / "data", train_rows=512, valid_rows=256, cardinality=5)
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "c"), "--tracking-uri", "none",
                 "--report-metrics", "tensorboard"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == "ctrflow train: error: --report-metrics: 'tensorboard' is not one of vertex, katib, none"
    assert not (tmp_path / "c").exists()
