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


class StorageError(FusionRAGError, OSError):
    """The disk refused a write (full, read-only, failing): the write was not applied and the
    collection stays readable."""


class UnavailableError(FusionRAGError):
    """The collection cannot serve now: it is closing (the service stops) or it failed to open (the
    message says why); other collections are not affected."""
