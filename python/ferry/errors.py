"""ferry's errors: one exception class per status code (abseil's numbers, as ferry/ferry.h)."""

from __future__ import annotations


class FerryError(Exception):
    """A call into ferry failed. `code` is the status code, the message says why."""

    code = 2

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


class Cancelled(FerryError):
    code = 1


class Unknown(FerryError):
    code = 2


class InvalidArgument(FerryError, ValueError):
    code = 3


class DeadlineExceeded(FerryError, TimeoutError):
    code = 4


class NotFound(FerryError, LookupError):
    code = 5


class AlreadyExists(FerryError):
    code = 6


class PermissionDenied(FerryError):
    code = 7


class ResourceExhausted(FerryError):
    code = 8


class FailedPrecondition(FerryError):
    code = 9


class Aborted(FerryError):
    code = 10


class OutOfRange(FerryError):
    code = 11


class Unimplemented(FerryError):
    code = 12


class Internal(FerryError):
    code = 13


class Unavailable(FerryError):
    code = 14


class DataLoss(FerryError):
    code = 15


class Unauthenticated(FerryError):
    code = 16


BY_CODE = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented,
    Internal, Unavailable, DataLoss, Unauthenticated)}


def from_code(code: int, message: str) -> FerryError:
    """The exception for status `code`."""
    return BY_CODE.get(code, Unknown)(message)
