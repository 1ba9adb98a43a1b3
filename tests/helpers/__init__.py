"""Shared test helpers (fakes, local receivers, tool launchers)."""
