"""Pieces of the training run that are not the model or the loop: checkpoint files and stop signals."""
