"""The learner service: algorithms, optimiser state, checkpoints and weight versions."""
