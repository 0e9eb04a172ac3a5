"""Slurm integration: environment parsing, sbatch rendering, node health and the launcher."""
