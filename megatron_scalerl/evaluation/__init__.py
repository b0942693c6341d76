"""Downstream evaluation (AIME, local benchmarks such as code): datasets, sampling through OpenAI-compatible
endpoints, grading, metrics, scheduled checkpoint evaluations."""
