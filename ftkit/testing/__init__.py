"""Test support: finding a running job's rank processes from outside (tests, benchmarks)."""
