"""The run's core: the training loop and what it uses (state, evaluation, checkpoints, metrics, watchdog)."""
