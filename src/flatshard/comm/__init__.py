"""Collectives as free functions, Gloo point-to-point, the debug checker, the fingerprint."""
