"""Test support: fault injection (FTKIT_FAULTS) and helpers for launching real jobs."""
