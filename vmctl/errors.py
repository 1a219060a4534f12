"""Errors raised by vmctl. Each carries a stable ``code`` and an HTTP status hint
(the gateway maps them to responses in one place)."""

from __future__ import annotations


class VmctlError(Exception):
    code = "vm_error"
    status = 500


class VMStartError(VmctlError):
    """The VMM process could not be started or exited during start-up."""

    code = "vm_start_failed"
    status = 502


class VMProtocolError(VmctlError):
    """The VMM's control channel (QMP, Firecracker API) answered with an error."""

    code = "vmm_protocol_error"
    status = 502


class VMTimeoutError(VmctlError):
    """A VMM or guest operation did not finish in time."""

    code = "vm_timeout"
    status = 504


class VMGoneError(VmctlError):
    """The VMM process is not running (crashed, killed, or already destroyed)."""

    code = "vm_gone"
    status = 502


class SnapshotError(VmctlError):
    """A snapshot is missing, incomplete, corrupt (SHA256 mismatch) or incompatible."""

    code = "snapshot_invalid"
    status = 502


class NetworkError(VmctlError):
    """Setting up or tearing down a sandbox's namespace, veth or TAP failed."""

    code = "network_error"
    status = 500


class ImageError(VmctlError):
    """A template image (kernel, rootfs, golden snapshot) is missing or broken."""

    code = "image_error"
    status = 500


class GuestReplyError(VmctlError):
    """The guest agent's reply broke the protocol: headers over the client's limits, or a
    body that is not the JSON the endpoint answers with. (The guest is untrusted: it may
    answer anything, and none of it may cost the host more than the bounds below.)"""

    code = "agent_protocol_error"
    status = 502


class GuestReplyTooLarge(GuestReplyError):
    """A reply (or one NDJSON line) from the guest agent exceeded its size cap."""

    code = "agent_reply_too_large"


class GuestReplyTimeout(VMTimeoutError, TimeoutError):
    """The guest agent did not finish its reply in time. Also a ``TimeoutError``, so
    callers that retry on timeouts (readiness polls) keep doing so."""

    code = "agent_timeout"


class MigrationError(VmctlError):
    """A live migration failed or was refused. The source VM is left running as it was
    and the destination torn down, unless ``OutcomeUnknown`` says otherwise. (Its code is
    the generic ``vm_error``: a drain is an operator's action, no API client sees it.)"""

    status = 502


class OutcomeUnknown(MigrationError):
    """The destination may have started the guest (its answer was lost): the source VM
    stays paused, so that one sandbox never runs on two hosts."""
