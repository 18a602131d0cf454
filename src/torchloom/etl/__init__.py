"""Spark side of torchloom: read, clean, deduplicate, split and tokenize labelled text (`prepare`)."""
