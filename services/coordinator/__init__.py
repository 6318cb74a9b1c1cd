"""The coordinator: runs, the macro workflow, placement, the worker registry and the public API."""
