"""Pipelines: multi-stage jobs (demo, evaluate, calibrate, generate, plan) that commands call.

Commands parse arguments and print; pipelines do the work and return results.
"""
