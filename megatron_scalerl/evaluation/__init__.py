"""Downstream evaluation (AIME): datasets, sampling through OpenAI-compatible endpoints, grading, metrics, scheduled checkpoint evaluations."""
