"""Policy families shared by the learner (which trains them) and the rollout (which acts with them) that wrap real
model families (transformers' pi0, ...), apart from services/core's small built-in models. Each is one module
behind ``policy.name`` (the POLICIES registry of services/core/policy_names.py); nothing here is imported until a run names it."""
