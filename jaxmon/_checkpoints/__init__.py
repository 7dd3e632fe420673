"""Checkpoints on Orbax: saving and restoring, integrity, step directories, failures, warm start."""
