"""The env service: a pool of vectorised simulators stepped over the data plane."""
