"""Serving an exported model dir: the REST server with dynamic batching (`server`), its Ray Serve twin
(`ray_engine`) and batch prediction over files on Spark or locally (`batch`).

Everything here reads only the exported directory (weights, tokenizer, torchloom.json); nothing imports
train/ or etl/. Heavy packages (torch, fastapi, ray, pyspark) are imported inside the functions that need them.
"""
