"""Tests of the gateway, its client library/CLI and the stack launcher."""
