"""Reading described raw files (CSV/TSV, plain or gzip, and Parquet) as preprocessing and predict both read them."""
