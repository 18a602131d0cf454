"""The text rules every side shares: clean.py (cleaning), truncation.py (which tokens a long text keeps).
"""
