"""Agents written with agent frameworks, trained unchanged on the combination lock (see README.md)."""
