"""Shared pieces of batchfleet: configuration, wire protocol, Redis key names, errors.

Nothing here imports torch or model code, so producers stay light.
"""
