"""Serving an exported model dir: the REST server with dynamic batching (`server`), its Ray Serve twin
(`ray_engine`), both running one HTTP app (`app`: the native API; `tei`: the TEI-compatible one; `api_common`:
what the two share), several models behind one endpoint (`fleet`, `fleet_api`, `split`). The served model itself
is model/served.py; scoring files is batch/'s, watching a model monitor/'s.

Everything here reads only the exported directory (weights, tokenizer, torchloom.json); nothing imports
train/ or etl/. Heavy packages (torch, fastapi, ray, pyspark) are imported inside the functions that need them.
"""
