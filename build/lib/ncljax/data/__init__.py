"""Datasets, noise and the input pipeline."""
