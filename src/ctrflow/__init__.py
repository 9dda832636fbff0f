"""ctrflow: an end-to-end click-through-rate recommender pipeline."""

__version__ = "0.1.0"
