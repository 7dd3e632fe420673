"""The run: the session, its hooks' plan, the dispatch of the compiled step, its batches and its stop."""
