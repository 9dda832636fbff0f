"""What the python-backend models of an exported Triton repository run, importable without Triton.

`serve/models/*.py` are the `model.py` files `ctrflow export` copies into the repository; they
only translate between Triton tensors and `serve.preprocess` / `serve.ranking`, so the logic is
here, where validation and the unit tests exercise it. `serve.preprocess` needs numpy and the
vocabularies only (no torch, no tritonclient), so the preprocessing model stays light.
`serve.tritonserver` starts a real `tritonserver` on such a repository (`ctrflow serve`, the tests).
"""

from ctrflow.datasets.criteo.columns import DENSE, SPARSE

RAW_INPUTS = (*DENSE, *SPARSE)  # the ensemble's BYTES inputs, one per raw Criteo field
