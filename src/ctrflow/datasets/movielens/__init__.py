"""A movielens-like synthetic dataset: users, movies, a multi-hot genre list, two numbers, a 0/1 label.

`ctrflow synth --dataset movielens-like` writes CSV day files (`day_0.csv`, ...) and, beside them,
their dataset description (`movielens.yaml`), which `ctrflow preprocess --dataset` reads. Labels come
from a hidden factorization-machine teacher (`ctrflow.datasets.teacher`), whose exact AUC per day
is in `synth.json`.
"""

from ctrflow.datasets.movielens.description import DESCRIPTION_FILE, NAME, description, description_text

__all__ = ["DESCRIPTION_FILE", "NAME", "description", "description_text"]
