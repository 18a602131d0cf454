"""`torchloom plan`: memory, FLOPs, communication and time per parallel strategy, by arithmetic alone.

Nothing here imports torch, transformers or numpy at import time; only `calibrate` does, lazily.
"""
