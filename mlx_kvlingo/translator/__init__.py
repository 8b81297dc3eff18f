"""The translator: per target layer, a linear map for keys and one for values.

- ``maps``: the :class:`Translator` module, its spec and its file format;
- ``align``: pairing two tokenizations of one text by characters;
- ``hub``: translator files by hub repo id; ``publish``: uploading one.
"""

from .maps import ModelIdentity, Translator, TranslatorSpec, load_translator
