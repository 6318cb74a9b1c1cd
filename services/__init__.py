"""rlfabric's services (learner, rollout, env, replay, coordinator, robot gateway), installed as ``rlfabric.services``.

The repository keeps them in services/ at its top; setup.py installs that directory under the rlfabric namespace.
Imported under its directory's name (``import services`` from the repository's root), it would be a second copy of
every module, with registries and process-wide settings of its own: that is refused here."""

if __name__ == "services":
    raise ImportError("import rlfabric.services (services/ is installed as rlfabric.services), not services")
