"""Pieces every service of the stack shares: flags from the environment, JSON logs, gRPC server plumbing."""
