"""A run and its files: run.py (the command's Run), rundir.py (the names), runfiles.py and
runfiles_checkpoints.py (the owner that moves them), runrecord.py (the record), ledger.py, store_tree.py and
outputs.py (what torchloom wrote, which --overwrite may delete), lease.py (one driver on a store). What a run
recorded, followed by a stage on its own, is the command line's (cli/recorded.py).
"""
