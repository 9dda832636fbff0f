"""Criteo raw format, synthetic data, preprocessing, the feature schema and the Parquet loader."""
