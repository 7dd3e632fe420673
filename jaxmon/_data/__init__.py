"""Data sources a session takes batches from: in-memory arrays and real loaders."""
