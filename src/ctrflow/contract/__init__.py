"""The feature contract: features, schema.json, dataset descriptions and the one raw -> ids transform
that preprocessing, predict, the registry and serving share. Imports nothing of ingestion."""
