"""Tests of the container deployment: the Dockerfile, the compose files and their commands."""
