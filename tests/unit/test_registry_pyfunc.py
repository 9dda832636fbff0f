"""The registry's raw-rows pyfunc for a dataset of its own: its signature is the description's raw
columns as strings, and it scores a DataFrame of the CSV's text as `ctrflow predict` scores the file."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from tests.fixtures.serving import checkpoint, movielens_data

mlflow = pytest.importorskip("mlflow")


def test_pyfunc_signature_and_scores_follow_the_description(tmp_path_factory, tmp_path):
    from ctrflow.predict import predict
    from ctrflow.registry import save_pyfunc

    raw, data = movielens_data(tmp_path_factory)
    ckpt = checkpoint(tmp_path_factory, "dcnv2", data)
    lines = (raw / "day_1.csv").read_text().splitlines()[:101]
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    predict(ckpt, data, [tmp_path / "rows.csv"], tmp_path / "scores.csv")
    offline = pd.read_csv(tmp_path / "scores.csv")["probability"].to_numpy()

    model = mlflow.pyfunc.load_model(str(save_pyfunc(ckpt, data, tmp_path / "pyfunc")))
    signature = model.metadata.get_input_schema()
    assert [(c.name, c.type.name) for c in signature.inputs] == [
        (name, "string") for name in ("age", "price", "userId", "movieId", "genres")]
    frame = pd.read_csv(tmp_path / "rows.csv", dtype=str, keep_default_na=False)  # timestamp, liked: ignored
    served = model.predict(frame)["probability"].to_numpy()
    assert np.abs(served - offline).max() <= 1e-6 and offline.std() > 1e-3
    with pytest.raises(Exception, match="genres"):
        model.predict(frame.drop(columns=["genres"]))
