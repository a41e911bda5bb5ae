"""Benchmarks and the chaos run: commands that exercise a running stack and print JSON."""
