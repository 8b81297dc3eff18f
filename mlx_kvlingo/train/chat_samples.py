"""Stage-2 samples from chats: the target's own answers, weighted by what they need.

A switch in a coding chat translates the conversation so far (a pasted module,
the first model's answer) and the target reads the new question itself. The
samples here are that: ``context`` is the chat up to the end of the first answer
(translated in training, as in a switch), ``continuation`` the question's turn and
the target's own greedy answer (read by the target, teacher-forced), and
``weights`` say which continuation tokens the KL counts:

- the question's and the template's tokens: 0 (the user wrote them);
- each answer token: ``floor`` plus how much less likely the target finds it
  without the paste (its NLL after the question alone minus its NLL after the whole
  chat, clipped to [0, ``cap``]), so tokens that depend on distant context weigh
  most; the answer's weights average 1.

:func:`build_chat_samples` writes them as JSON lines (one per chat, appended as
each is done, so an interrupted build resumes); :class:`.samples.ChatSamples`
reads them for ``train`` (``--corpus chats:FILE.jsonl``). Both models must share a tokenizer
(the Qwen2.5-Coder pair does): a context's tokens are then read alike by both.
"""

import json
from pathlib import Path
from typing import Callable, List, Sequence

import mlx.core as mx
from mlx_lm import stream_generate

from ..errors import KvlingoError
from ..metrics import log_softmax, nll


def chat_ids(tokenizer, messages: List[dict], generation_prompt: bool) -> List[int]:
    """The token ids of ``messages`` in the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    return list(ids)


def answer_weights(full_nll: Sequence[float], short_nll: Sequence[float],
                   floor: float = 0.25, cap: float = 4.0) -> List[float]:
    """Each answer token's weight: ``floor`` + its NLL without the paste minus its
    NLL with it (clipped to [0, ``cap``]), scaled so the weights average 1."""
    raw = [floor + min(max(s - f, 0.0), cap) for f, s in zip(full_nll, short_nll)]
    mean = sum(raw) / len(raw) if raw else 1.0
    return [w / mean for w in raw]


def _greedy(model, tokenizer, prompt: List[int], max_tokens: int):
    """(tokens, their NLL) of the model's greedy answer, the end token included."""
    tokens, nll = [], []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        tokens.append(int(r.token))
        nll.append(-float(r.logprobs[r.token]))
    return tokens, nll


def _nll(model, ids: List[int], start: int) -> List[float]:
    """The NLL of ``ids[start:]`` read teacher-forced after ``ids[:start]``."""
    logprobs = log_softmax(model(mx.array(ids)[None])[0, start - 1 : len(ids) - 1])
    return nll(logprobs, mx.array(ids[start:])).tolist()


def build_chat_samples(source, tokenizer, target, chats, out: Path,
                       first_answer_tokens: int = 32, answer_tokens: int = 48,
                       log: Callable[[str], None] = print) -> int:
    """Write one sample per chat (:class:`data.code_chats.CodeChat`) to ``out`` (JSON
    lines): the source answers the paste, the target the question. Chats already in
    ``out`` are skipped. Returns the number of samples in ``out``."""
    if not getattr(tokenizer, "chat_template", None):
        raise KvlingoError("Chat samples need a chat model: this tokenizer has no chat template.")
    out = Path(out)
    done = {json.loads(line)["index"] for line in out.read_text().splitlines()
            if line.strip()} if out.exists() else set()
    for i, chat in enumerate(chats):
        if i in done:
            continue
        first = [{"role": "user", "content": chat.paste}]
        said, _ = _greedy(source, tokenizer, chat_ids(tokenizer, first, True),
                          first_answer_tokens)
        history = first + [{"role": "assistant",
                            "content": tokenizer.decode(said, skip_special_tokens=True).strip()}]
        context = chat_ids(tokenizer, history, False)
        prompt = chat_ids(tokenizer, history + [{"role": "user", "content": chat.question}], True)
        if prompt[: len(context)] != context:
            raise KvlingoError("The chat template does not extend a conversation by appending "
                               "to it: chat samples need one that does.")
        answer, full_nll = _greedy(target, tokenizer, prompt, answer_tokens)
        alone = chat_ids(tokenizer, [{"role": "user", "content": chat.question}], True)
        short_nll = _nll(target, alone + answer, len(alone))
        asked = len(prompt) - len(context)
        row = {"index": i, "kind": chat.kind, "context": context,
               "continuation": prompt[len(context):] + answer,
               "weights": [0.0] * asked + answer_weights(full_nll, short_nll),
               "answer": tokenizer.decode(answer, skip_special_tokens=True)}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        done.add(i)
        log(f"chat {i + 1}/{len(chats)} ({chat.kind}): {len(context)} context tokens, "
            f"answer {row['answer'][:60]!r}")
    return len(done)
