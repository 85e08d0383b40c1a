"""Errors of the IR package. Each names what is wrong and what to do about it."""

from __future__ import annotations


class IRError(Exception):
    """Base class of every error this package raises."""


class ManifestError(IRError):
    """The manifest is missing, malformed, or disagrees with the files it describes."""


class HashMismatch(IRError):
    """A file's SHA-256 differs from the manifest's: it is corrupt or was tampered with."""


class CorruptModel(IRError):
    """An ONNX file does not parse or fails `onnx.checker`."""


class ForbiddenOperator(IRError):
    """A graph uses an operator outside the standard ONNX domains (a custom op)."""


class UnsafeExternalData(IRError):
    """A tensor's external data points outside the package directory."""


class TooLarge(IRError):
    """A file or graph exceeds the configured size limit."""


class UnsupportedModel(IRError):
    """The model's architecture or the requested split is not supported."""


class ExecutorError(IRError):
    """Inputs do not match the stage, or the runtime failed to run it."""


class PretrainError(ExecutorError):
    """A pre-training request does not fit the package or the run; the message says why."""
