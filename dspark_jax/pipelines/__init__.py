"""Pipelines: multi-stage jobs (demo, evaluate, calibrate, plan) that commands call.

Commands parse arguments and print; pipelines do the work and return results.
"""
