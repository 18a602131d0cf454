"""The object-store client: storage.py (the verbs), clients.py (the filesystems), errors.py (retries and
what to check). Only runs/runfiles.py moves a run's files with it; the input readers and the model fetch read
URIs a user gave.
"""
