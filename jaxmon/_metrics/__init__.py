"""Metrics over steps on the device: reductions as values, and the session's accumulators."""
