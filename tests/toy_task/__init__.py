"""A test-only task, `toy`, in its own folder: registered by tests/test_toy_task.py, never by importing it."""
