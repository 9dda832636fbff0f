"""Preprocessing: the two passes (count -> vocabulary -> transform) on worker processes, CPU and GPU
engines, output layout, accounting and the per-file fan-out."""
