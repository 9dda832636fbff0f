"""Training: the loop (`loop.train`), optimizers and LR schedule, checkpoints, process helpers."""
