"""What one turn of a :class:`~mlx_kvlingo.chat.session.Session` cost (its report),
and the iterator of a streaming turn."""

from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

from mlx_lm.generate import GenerationResponse


@dataclass
class TurnReport:
    """What one turn cost. ``prefilled`` counts every position the model computed
    itself before its first generated token: the turn's own new tokens
    (``new_tokens``), translators' native prefix and native tail, and spans without a
    translator."""

    index: int
    model: str
    kind: str = "generate"  # or "read"
    translated: int = 0
    prefilled: int = 0
    generated: int = 0
    new_tokens: int = 0
    translated_from: Dict[str, int] = field(default_factory=dict)
    context_tokens: int = 0  # transcript length when the model started its own tokens
    translate_s: float = 0.0  # catching up (translation and any fallback prefill)
    ttft_s: Optional[float] = None  # start of the turn to first generated token
    total_s: float = 0.0
    wait_s: float = 0.0  # time waiting for another thread's turn to finish
    text: str = ""
    finish_reason: Optional[str] = None
    warnings: List[str] = field(default_factory=list)
    gate: Optional[dict] = None  # the quality gate's numbers and decision (gate.py)
    fallback: Optional[str] = None  # why translated positions were recomputed natively
    native_tail: int = 0  # last catch-up positions computed natively over the translation
    recomputed: int = 0  # translated positions recomputed natively (fact-like words)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        ttft = f", first token after {self.ttft_s * 1e3:.1f} ms" if self.ttft_s is not None else ""
        return (f"{self.model}: translated {self.translated}, prefilled {self.prefilled}, "
                f"generated {self.generated}{ttft}")


def format_reports(reports: Sequence[TurnReport]) -> str:
    """A plain-text table of turn reports."""
    lines = [f"{'turn':>4} {'model':<12} {'context':>7} {'translated':>10} {'prefilled':>9} "
             f"{'generated':>9} {'TTFT ms':>8} {'translate ms':>12}"]
    for r in reports:
        ttft = f"{r.ttft_s * 1e3:.1f}" if r.ttft_s is not None else "-"
        lines.append(
            f"{r.index:>4} {r.model:<12} {r.context_tokens:>7} {r.translated:>10} "
            f"{r.prefilled:>9} {r.generated:>9} {ttft:>8} {r.translate_s * 1e3:>12.1f}"
        )
        lines += [f"     ! {w}" for w in r.warnings]
    return "\n".join(lines)


class TurnStream:
    """Iterator over one streaming turn's mlx-lm ``GenerationResponse``s.

    ``report`` is filled in as the turn runs and is final once the iterator is
    exhausted or closed. Close it (or use it as a context manager) to stop a turn
    early: the tokens generated so far stay in the conversation.
    """

    def __init__(self, gen: Iterator[GenerationResponse], report: TurnReport):
        self._gen = gen
        self.report = report

    def __iter__(self):
        return self

    def __next__(self) -> GenerationResponse:
        return next(self._gen)

    def close(self):
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
