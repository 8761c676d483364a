"""Sparse-communication data-parallel fine-tuning (a plain library, no web code)."""
