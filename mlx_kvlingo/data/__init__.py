"""Text for fitting and measuring translators, all of it offline: the standard
library's docstrings, files and hub datasets a user names (``corpus``), and
English prose read out of a Debian package (``prose``)."""
