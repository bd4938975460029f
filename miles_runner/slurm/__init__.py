"""Running plans on a Slurm cluster: the job script rendered from a plan, submission as one job array, the
sweep manifest and job states. The Hydra launcher `hydra/launcher=miles_slurm` (hydra_plugins/) drives it."""
