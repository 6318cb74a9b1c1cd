"""Shared runtime of every service: config schema, tensor codec, data plane, gRPC runtime, object store."""
