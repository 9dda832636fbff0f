"""Triton python-backend model `NAME_preprocess`: raw Criteo fields -> ranking-model inputs.

Copied by `ctrflow export` to `REPO/NAME_preprocess/1/model.py`, with the saved vocabularies in
`1/vocab/`. It runs ctrflow's own `transform_raw`, the code that preprocessed the training data,
so serving cannot drift from training. A malformed field gets an error response naming it; the
other requests of the batch are answered normally.
"""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from ctrflow.errors import UserError
from ctrflow.serve import RAW_INPUTS
from ctrflow.serve.preprocess import load_vocabularies, preprocess_arrays

HERE = Path(__file__).resolve().parent


class TritonPythonModel:
    """Inputs I1..I13, C1..C26 (BYTES [B, 1]); outputs dense FP32 [B, 13], sparse INT64 [B, 26]."""

    def initialize(self, args):
        self.vocab = load_vocabularies(HERE)

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        arrays = {}
        for name in RAW_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            arrays[name] = None if tensor is None else tensor.as_numpy()
        try:
            dense, sparse = preprocess_arrays(arrays, self.vocab)
        except UserError as err:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err)))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("dense", dense),
                                                          pb_utils.Tensor("sparse", sparse)])
