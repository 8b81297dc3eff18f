"""matplotlib, imported only where a plot is drawn: it is the optional ``plot``
extra (``pip install "mlx-kvlingo[plot]"``)."""

from .errors import KvlingoError

INSTALL_HINT = 'pip install "mlx-kvlingo[plot]"'


def available() -> bool:
    """Whether matplotlib can be imported here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend; a KvlingoError naming the
    extra to install when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise KvlingoError(f"Plots need matplotlib, which is not installed: {INSTALL_HINT}"
                           ) from e
    return plt
