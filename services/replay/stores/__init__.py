"""Replay stores behind one interface (memory now; Redis joins by config)."""
