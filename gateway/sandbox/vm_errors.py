"""The VM layer's errors, as the layers above the sandbox catch them.

vmctl raises its own errors; each carries an HTTP ``status`` hint and a stable ``code``,
like our ``ApiError``. The HTTP middleware (gateway.http.middleware) and the preview host
router (gateway.preview.hosts) turn them into responses; they name them through this
module, so that nothing above the sandbox layer imports vmctl (tests/unit/test_walls.py).
"""

from __future__ import annotations

from vmctl.agent_client import AgentError
from vmctl.errors import VmctlError

__all__ = ["GuestAgentError", "VmError"]

# Anything vmctl raises: a VM that would not start or restore, a guest agent that is
# unreachable or answered badly, an image or network failure.
VmError = VmctlError
# The guest agent answered with an error of its own (a ``VmError``): its status and code
# pass through unchanged, and it is the request's fault or the guest's, never ours.
GuestAgentError = AgentError
