"""memcalc verify: build the real model in PyTorch, train a few steps, measure, compare.

This package imports torch; memcalc/ never does. The entry points are in verify.run.
"""
