"""Criteo's fast paths: its TSV parsed and counted as 8-byte keys, and the GPU engine."""
