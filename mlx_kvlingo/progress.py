"""Progress bars on standard error (tqdm, which huggingface-hub already brings)."""

import sys
from typing import Iterable, Optional


def enabled(progress: Optional[bool] = None) -> bool:
    """``progress`` None: bars only when standard error is a terminal."""
    if progress is None:
        return sys.stderr.isatty()
    return bool(progress)


def bar(iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "",
        progress: Optional[bool] = False, unit: str = "it", **kwargs):
    """A tqdm bar on standard error, drawn only when :func:`enabled`; otherwise a
    silent pass-through with the same interface (``update``, ``write``, ...)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr,
                disable=not enabled(progress), dynamic_ncols=True, **kwargs)


def around_bars(log):
    """``log`` that first clears any bar drawn (and redraws it after), so printed
    lines and bars do not run into each other on a terminal."""
    from tqdm.auto import tqdm

    def write(message):
        with tqdm.external_write_mode():
            log(message)

    return write
