"""Evaluation: metrics from predicted probabilities, and the report (JSON, Markdown, plots)."""
