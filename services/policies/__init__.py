"""Policy families shared by the learner (which trains them) and the rollout (which acts with them) that wrap real
model families (transformers' pi0, ...), apart from services/core's small built-in models. Each is one module behind
``policy.name``, registered as a plug-in's policy is: entry points of rlfabric's pyproject.toml, its class
(``rlfabric.policies``) and its options section ``policy.<name>`` (``rlfabric.policy_options``: options.py, which
imports no torch, since the coordinator validates every spec with it). services/core names none of them; nothing
here but options.py is imported until a run names a policy."""
