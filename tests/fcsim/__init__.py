"""Firecracker API simulator for tests (no guest is run; see server.py)."""

from tests.fcsim.server import DEFAULT_VERSION, Fault, Simulator, VMState, make_app, validate

__all__ = ["DEFAULT_VERSION", "Fault", "Simulator", "VMState", "make_app", "validate"]
