"""Algorithm specs, one file each (see rlfabric.services.core.algorithm for what a spec declares).

Every module here registers its ``Algorithm`` subclass with ``@register``; the ``rlfabric.algorithms`` entry point
(pyproject.toml) names this package, so a new algorithm is a new file and nothing else. Every process imports
these files (tests/unit/test_imports.py keeps that free of torch): they bind ``torch = lazy_import("torch")``.
"""
