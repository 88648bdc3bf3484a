"""Foundations: config schema, errors, run-folder contract, fault grammar, host facts, process groups."""
