"""The rollout service: acts in the env pool with an inference backend and produces trajectories."""
