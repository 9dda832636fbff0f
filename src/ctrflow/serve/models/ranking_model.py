"""Triton python-backend model `NAME_model`: dense, sparse -> probability, with PyTorch.

Copied by `ctrflow export --backend python` to `REPO/NAME_model/1/model.py`, with the weights in
`1/checkpoint/`. It serves on any Triton build that has the python backend (no ONNX runtime).
Requests the dynamic batcher groups together run as one forward pass.
"""

from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ctrflow.schema import Schema
from ctrflow.errors import UserError
from ctrflow.serve.ranking import check_features, load_ranking_model, probabilities

HERE = Path(__file__).resolve().parent


class TritonPythonModel:
    """Inputs dense FP32 [B, 13], sparse INT64 [B, 26]; output probability FP32 [B, 1]."""

    def initialize(self, args):
        gpu = args.get("model_instance_kind") == "GPU" and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu")
        self.model = load_ranking_model(HERE / "checkpoint").to(self.device)
        schema = Schema.load(HERE / "checkpoint")
        self.table_sizes, self.features = schema.table_sizes(), schema.features

    def execute(self, requests):
        valid, errors = [], {}
        for i, request in enumerate(requests):
            dense = pb_utils.get_input_tensor_by_name(request, "dense").as_numpy()
            sparse = pb_utils.get_input_tensor_by_name(request, "sparse").as_numpy()
            try:
                check_features(dense, sparse, self.table_sizes, self.features)
                valid.append((i, dense, sparse))
            except UserError as err:
                errors[i] = pb_utils.TritonError(str(err))
        outputs = {}
        if valid:
            scores = probabilities(self.model, np.concatenate([d for _, d, _ in valid]),
                                   np.concatenate([s for _, _, s in valid]), self.device)
            start = 0
            for i, dense, _ in valid:
                outputs[i] = [pb_utils.Tensor("probability", scores[start:start + len(dense)])]
                start += len(dense)
        return [pb_utils.InferenceResponse(output_tensors=outputs.get(i, []), error=errors.get(i))
                for i in range(len(requests))]
