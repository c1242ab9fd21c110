"""What spans processes: jax.distributed start-up and cross-process
agreement, SLURM, rank-zero utilities."""
