"""Any described table (CSV/TSV/Parquet): its fit and transform stages."""
