"""The orchestrator's side of a run: admission, generating and grading groups, building batches, validation, the
live forecast, and the saved state a resume continues from."""
