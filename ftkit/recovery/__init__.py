"""Restore: discover the newest usable committed step, rebuild, load."""
