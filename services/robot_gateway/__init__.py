"""The robot gateway: real and simulated arms behind one control loop with deadlines, safety limits and fail-safes."""
