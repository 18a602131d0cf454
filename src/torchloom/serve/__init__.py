"""Serving an exported model dir: the REST server with dynamic batching (`server`), its Ray Serve twin
(`ray_engine`), both running one HTTP app (`app`: the native API; `tei`: the TEI-compatible one; `api_common`:
what the two share), and scoring files on Spark or locally (`score_files`).

Everything here reads only the exported directory (weights, tokenizer, torchloom.json); nothing imports
train/ or etl/. Heavy packages (torch, fastapi, ray, pyspark) are imported inside the functions that need them.
"""
