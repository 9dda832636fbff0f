"""The `model.py` files `ctrflow export` copies into a Triton repository.

They import `triton_python_backend_utils`, which exists only inside Triton's python backend:
Triton imports them, ctrflow never does.
"""
