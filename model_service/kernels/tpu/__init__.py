"""Pallas TPU kernels for the generic backend (they also run on CPU in Pallas interpret mode, which the tests use).

grouped_matmul: rows sorted by group (expert) times each group's int8 matrix, widened inside its tiles.
"""
