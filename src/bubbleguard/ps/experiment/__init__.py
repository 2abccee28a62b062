"""Runs and experiments: one run measured, strategies compared over seeds, tables and plots."""
