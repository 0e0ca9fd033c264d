"""Benchmarks with committed results (see docs/benchmarks.md)."""
