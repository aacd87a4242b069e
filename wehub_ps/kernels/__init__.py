"""Compiled and vectorised loops over arrays: row gathers and scatters, segment
sums, and the numba helper that compiles them.
"""
