"""rlfabric: RL post-training as independent services (learner, rollout, env, replay, coordinator)."""
