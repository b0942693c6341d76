"""What the model is asked and how its answers are graded: `problems` (the sources' rows), `prompts` (templates, the
validation split, the sampler and mixtures), `verifiers` (the registry, math), `code_verifier` and `sandbox` (code run
against tests), `rewards` (the grader's worker pool), `synthetic` (our generated tasks); docs/tasks.md."""
