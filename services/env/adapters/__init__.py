"""Adapters from simulator libraries to vector envs the EnvPool can step."""
