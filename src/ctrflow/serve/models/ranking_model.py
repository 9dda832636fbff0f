"""Triton python-backend model `NAME_model`: dense, sparse -> probability, with PyTorch.

Copied by `ctrflow export --backend python` to `REPO/NAME_model/1/model.py`, with the weights in
`1/checkpoint/`. It serves on any Triton build that has the python backend (no ONNX runtime).
Requests the dynamic batcher groups together run as one forward pass.
"""

from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ctrflow.errors import UserError
from ctrflow.contract.schema import Schema
from ctrflow.serve import model_inputs
from ctrflow.serve.ranking import check_features, load_ranking_model, probabilities

HERE = Path(__file__).resolve().parent


class TritonPythonModel:
    """Inputs dense FP32 [B, num_dense] and sparse INT64 [B, slots] (each only when it has a
    column); output probability FP32 [B, 1]."""

    def initialize(self, args):
        gpu = args.get("model_instance_kind") == "GPU" and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu")
        self.model = load_ranking_model(HERE / "checkpoint").to(self.device)
        self.features = Schema.load(HERE / "checkpoint").features
        self.inputs = model_inputs(self.features)

    def _inputs(self, request) -> dict:
        found = {}
        for name in ("dense", "sparse"):
            tensor = pb_utils.get_input_tensor_by_name(request, name) if name in self.inputs else None
            found[name] = None if tensor is None else tensor.as_numpy()
        return found

    def execute(self, requests):
        valid, errors = [], {}
        for i, request in enumerate(requests):
            given = self._inputs(request)
            try:
                check_features(given["dense"], given["sparse"], self.features)
                valid.append((i, given["dense"], given["sparse"]))
            except UserError as err:
                errors[i] = pb_utils.TritonError(str(err))
        outputs = {}
        if valid:  # one forward pass for every valid request of the batch
            joined = [None if valid[0][k] is None else np.concatenate([v[k] for v in valid]) for k in (1, 2)]
            scores = probabilities(self.model, *joined, self.device)
            start = 0
            for i, dense, sparse in valid:
                rows = len(dense if dense is not None else sparse)
                outputs[i] = [pb_utils.Tensor("probability", scores[start:start + rows])]
                start += rows
        return [pb_utils.InferenceResponse(output_tensors=outputs.get(i, []), error=errors.get(i))
                for i in range(len(requests))]
