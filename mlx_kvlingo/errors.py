"""The package's own error types: every failure a user can cause raises one of these."""


class KvlingoError(Exception):
    """Base class for errors caused by input to mlx-kvlingo (models, files, arguments)."""


class UnsupportedModel(KvlingoError):
    """The model's cache holds no per-token keys and values a translator can use."""


class TranslatorFileError(KvlingoError):
    """A translator file is missing, truncated, damaged or of another format."""


class TranslatorMismatch(KvlingoError):
    """A translator was trained for models other than the ones given."""
