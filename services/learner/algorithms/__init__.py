"""Algorithm specs, one file each (see services.core.algorithm for what a spec declares).

Every module here registers its ``Algorithm`` subclass with ``@register``; the ``rlfabric.algorithms`` entry point
(pyproject.toml) names this package, so a new algorithm is a new file and nothing else.
"""
