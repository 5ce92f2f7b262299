"""Prompt search: find the best prompt template for a set of tasks (see README.md here)."""
