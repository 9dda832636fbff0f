"""Triton python-backend model `NAME_preprocess`: raw columns -> ranking-model inputs.

Copied by `ctrflow export` to `REPO/NAME_preprocess/1/model.py`, with `1/schema.json` (the
feature contract and the dataset description) and the saved vocabularies in `1/vocab/`. It runs
ctrflow's own `transform_raw`, the code that preprocessed the training data, so serving cannot
drift from training. A malformed field gets an error response naming it; the other requests of
the batch are answered normally.
"""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from ctrflow.errors import UserError
from ctrflow.serve import model_inputs, raw_inputs
from ctrflow.serve.preprocess import load_preprocessing, preprocess_arrays

HERE = Path(__file__).resolve().parent


class TritonPythonModel:
    """Inputs: one BYTES [B, 1] per raw column of the schema; outputs dense FP32 [B, num_dense]
    and sparse INT64 [B, slots] (each only when it has a column)."""

    def initialize(self, args):
        self.schema, self.vocab = load_preprocessing(HERE)
        self.inputs, self.outputs = raw_inputs(self.schema), model_inputs(self.schema)

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        arrays = {}
        for name in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            arrays[name] = None if tensor is None else tensor.as_numpy()
        try:
            dense, sparse = preprocess_arrays(arrays, self.schema, self.vocab)
        except UserError as err:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err)))
        tensors = {"dense": dense, "sparse": sparse}
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, tensors[name])
                                                          for name in self.outputs])
