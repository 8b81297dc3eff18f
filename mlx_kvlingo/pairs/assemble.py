"""A conversation's models and translators, assembled from what a user names: the
`chat` and `serve` commands' sessions."""

from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ..chat.session import Session
from ..errors import KvlingoError
from ..models.geometry import cache_geometry, model_name
from ..models.load import load
from ..switching.break_even import break_even_for
from ..translator.maps import load_translator
from .builtin import builtin_session, stage1_translator
from .shipped import load_shipped


def parse_models(specs: List[str]):
    """NAME=PATH or PATH (named after the directory)."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name or spec, spec
        if not name or not path:
            raise KvlingoError(f"--model expects NAME=PATH or PATH, got {spec!r}.")
        if name in out:
            raise KvlingoError(f"Two models are named {name!r}; use NAME=PATH.")
        out[name] = path
    return out


def match_translator(translator, session, path: str):
    """(source, target) names a translator file fits, from its recorded model names
    or, failing that, from cache geometry."""
    def candidates(ident):
        names = session.model_names
        by_name = [n for n in names if model_name(session.model(n)) == ident.name]
        if len(by_name) == 1:
            return by_name
        return [n for n in names
                if cache_geometry(session.model(n)).fingerprint() == ident.fingerprint]

    sources = candidates(translator.spec.source)
    targets = candidates(translator.spec.target)
    pairs = [(s, t) for s in sources for t in targets if s != t]
    if len(pairs) != 1:
        raise KvlingoError(
            f"Cannot tell which models translator {path} connects "
            f"({'no' if not pairs else 'several'} candidates); "
            "write --translator SOURCE:TARGET=FILE."
        )
    return pairs[0]


def build_session(models: Sequence[str], translators: Sequence[str] = (), fit_missing: bool = True,
                  fit_tokens: int = 10_000, cache_dir=None, system: Optional[str] = None,
                  log: Callable[[str], None] = print, recompute: Optional[float] = None,
                  recompute_max: Optional[int] = None, keep_quantized: bool = False) -> Session:
    """A Session over the models named ``NAME=PATH`` (or ``PATH``), with the
    translators given as ``SOURCE:TARGET=FILE`` (or ``FILE``, matched to the models
    it fits), the shipped ones between models named by their short names, and, with
    ``fit_missing``, a stage-1 translator fitted on the spot for every other
    direction. No models: the built-in pair. ``recompute``, ``recompute_max``: see
    :class:`Session`. ``keep_quantized``: see :func:`~mlx_kvlingo.models.load.load`."""
    if not models:
        if translators:
            raise KvlingoError("--translator needs --model (the built-in pair brings its own).")
        log("No --model given: using the built-in pair (small = qwen3, large = llama).")
        return builtin_session(cache_dir, fit_tokens, log=log, system_prompt=system,
                               recompute=recompute, recompute_max=recompute_max)
    paths = parse_models(models)
    if len(paths) < 2:
        raise KvlingoError("Give at least two --model options (or none for the built-in pair).")
    session = Session(system_prompt=system, recompute=recompute, recompute_max=recompute_max)
    for name, path in paths.items():
        log(f"Loading {name} from {path} ...")
        model, tokenizer = load(path, keep_quantized=keep_quantized)
        session.add_model(name, model, tokenizer)
    for spec in translators:
        pair, sep, file = spec.rpartition("=")
        t = load_translator(file)
        if sep and ":" in pair:
            src, _, tgt = pair.partition(":")
        elif sep:
            raise KvlingoError(f"--translator expects SOURCE:TARGET=FILE or FILE, got {spec!r}.")
        else:
            src, tgt = match_translator(t, session, file)
        session.add_translator(src, tgt, t)
    add_shipped_translators(session, paths, log)
    if fit_missing:
        for s in session.model_names:
            for t in session.model_names:
                if s != t and not session.has_translator(s, t):
                    session.add_translator(s, t, stage1_translator(
                        session.model(s), session.tokenizer_of(s), session.model(t),
                        session.tokenizer_of(t), cache_dir, fit_tokens, log=log))
    return session


def add_shipped_translators(session, paths, log: Callable[[str], None] = print):
    """Directions still without a translator between models named by a short name
    the package ships translators for (``--model smol=smollm2 --model gemma=gemma3``)
    use the shipped ones."""
    for s, src in paths.items():
        for t, tgt in paths.items():
            if s != t and not session.has_translator(s, t):
                shipped = load_shipped(str(src), str(tgt))
                if shipped is not None:
                    log(f"Using the shipped translator {src} -> {tgt} for {s} -> {t}.")
                    session.add_translator(s, t, shipped)


def describe_session(session: Session) -> str:
    """The models of a session and its translators, one per line."""
    lines = []
    for name in session.model_names:
        lines.append(f"  {name}: {model_name(session.model(name))}")
    pairs = [f"{s} -> {t}" for s in session.model_names for t in session.model_names
             if s != t and session.has_translator(s, t)]
    missing = [f"{s} -> {t}" for s in session.model_names for t in session.model_names
               if s != t and not session.has_translator(s, t)]
    lines.append("  translators: " + (", ".join(pairs) or "none"))
    if pairs:
        lines.append("  break-even: " + _break_evens(session))
    if missing:
        lines.append("  no translator (falls back to prefill): " + ", ".join(missing))
    return "\n".join(lines)


def _break_evens(session: Session) -> str:
    """The shortest catch-up each direction translates (switching.break_even)."""
    if session.break_even is not None:
        return f"catch-ups under {session.break_even} positions prefill (set)"
    found = []
    for s in session.model_names:
        for t in session.model_names:
            if s != t and session.has_translator(s, t):
                n, where = break_even_for(session.translator(s, t), session.model(t))
                found.append(f"{s} -> {t} " + (f"{n} ({where})" if n or where != "the file's"
                                                else "not measured"))
    return ", ".join(found) + " (positions; `mlx-kvlingo break-even` measures it here)"
