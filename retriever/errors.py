"""Errors the engine raises on bad input. Each message names what was wrong and where."""


class FusionRAGError(Exception):
    """Base class of the errors fusionrag raises on purpose."""


class ConfigError(FusionRAGError, ValueError):
    """A configuration value or search parameter is out of range."""


class InputError(FusionRAGError, ValueError):
    """Vectors or queries that cannot be used: wrong shape or dimension, NaN/inf, empty."""


class VectorFileError(InputError):
    """A vector file that cannot be read: unknown extension, truncated, inconsistent rows."""


class IndexFormatError(FusionRAGError):
    """An index directory that is missing, incomplete, corrupt or from a newer version."""


class NotFoundError(FusionRAGError, LookupError):
    """A collection or document that does not exist."""


class ConflictError(FusionRAGError):
    """The request clashes with what exists: a collection name already taken, say."""


class QuotaError(ConflictError):
    """One more would pass a configured limit: collections in all or per key, snapshots of a collection."""


class StorageError(FusionRAGError, OSError):
    """The disk refused a write (full, read-only, failing): the write was not applied and the
    collection stays readable."""


class UnsupportedError(FusionRAGError):
    """What this kind of collection does not do (a sharded collection is not dropped or snapshotted through the
    service, say): the same request to another kind would be served."""


class UnavailableError(FusionRAGError):
    """The collection cannot serve now: it is closing (the service stops) or it failed to open (the
    message says why); other collections are not affected."""


# The one table of errors and HTTP statuses, read both ways: the service answers an error with the status of
# the first class here it is an instance of (anything else: 500), and the client (fusionrag.client) raises for
# a status the class of its first row, so code catches the same classes in-process and remotely. 400 and 413
# are the service's own refusals of a body, raised back as InputError too.
HTTP_STATUSES: tuple[tuple[type[FusionRAGError], int], ...] = (
    (NotFoundError, 404), (ConflictError, 409), (InputError, 422), (ConfigError, 422), (StorageError, 507),
    (UnavailableError, 503), (UnsupportedError, 405), (InputError, 400), (InputError, 413))


def http_status(error: BaseException) -> int | None:
    """The status the service answers this error with; None for one it does not expect (a 500)."""
    return next((status for cls, status in HTTP_STATUSES if isinstance(error, cls)), None)


def error_class(status: int) -> type[FusionRAGError] | None:
    """The class the client raises for an error status; None where the table has no row (401, 403, 500 ...)."""
    return next((cls for cls, s in HTTP_STATUSES if s == status), None)
