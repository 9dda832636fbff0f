"""Synthetic datasets (criteo-like, movielens-like) labelled by a hidden teacher, with drift."""
