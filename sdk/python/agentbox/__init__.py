"""AgentBox: the Python SDK for self-hosted microVM sandboxes.

    from agentbox import AgentBox
    box = AgentBox(api_key=...)              # or AGENTBOX_API_KEY / AGENTBOX_URL
    sandbox = box.create(environment="python")
    result = sandbox.execute("print(1)")
    print(result.stdout)

Also ``Sandbox.create()`` / ``Sandbox.connect(id)`` (E2B style), named long-lived
sessions (``box.sessions.put(name, start=...)``) and the asyncio twins
``AsyncAgentBox`` / ``AsyncSandbox``. Errors are in ``agentbox.exceptions``.
This package imports nothing from the server side: it works installed alone.
"""

from agentbox.async_commands import AsyncCommandHandle
from agentbox.async_sandbox import AsyncSandbox
from agentbox.client import AgentBox, AsyncAgentBox
from agentbox.commands import CommandHandle
from agentbox.exceptions import (
    AgentBoxError,
    APIConnectionError,
    AuthenticationError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    PayloadTooLargeError,
    QuotaExceededError,
    RateLimitError,
    SandboxError,
    SandboxNotFoundError,
    SessionNotFoundError,
    TemplateNotFoundError,
    TimeoutError as TimeoutError,  # not in __all__: a star import must not shadow the builtin
    UnavailableError,
)
from agentbox.async_files import AsyncByteStream
from agentbox.files import ByteStream
from agentbox.models import (
    CodeContext,
    CommandResult,
    Execution,
    ExecutionError,
    ExecResult,
    FileInfo,
    OutputChunk,
    PreviewAccess,
    ProcessInfo,
    Result,
    SandboxInfo,
    ServerInfo,
    Session,
    Template,
)
from agentbox.sandbox import Sandbox

__version__ = "0.1.0"

__all__ = [
    "APIConnectionError", "AgentBox", "AgentBoxError", "AsyncAgentBox", "AsyncByteStream",
    "AsyncCommandHandle", "AsyncSandbox", "AuthenticationError", "ByteStream", "CodeContext",
    "CommandHandle", "CommandResult", "ConflictError", "ExecResult", "Execution",
    "ExecutionError", "FileInfo", "InvalidArgumentError", "NotFoundError", "OutputChunk",
    "PayloadTooLargeError", "PreviewAccess", "ProcessInfo", "QuotaExceededError",
    "RateLimitError", "Result", "Sandbox", "SandboxError",
    "SandboxInfo", "SandboxNotFoundError", "ServerInfo", "Session", "SessionNotFoundError",
    "Template", "TemplateNotFoundError", "UnavailableError", "__version__",
]
