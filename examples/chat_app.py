"""A minimal local chat app: the small model answers, the large one takes over when
asked — without re-reading the conversation.

Runs as it stands on the built-in pair (fits its translators once, then cached):

    python examples/chat_app.py

Type a message to chat. The app escalates to the large model when you start a
message with "/big", when the message is long, or when it asks for an explanation
(a simple rule: edit `wants_large`). On a switch the large model translates the
small model's cache of everything it has not read, then processes only your new
message. One line per turn shows what that cost. End with Ctrl-D.

The Session is called from a worker thread, as a GUI or web app would, while the
main thread reads input; the Session serializes turns with its own lock.
"""

import queue
import sys
import threading

import mlx_kvlingo  # noqa: F401  (first: fast BLAS on Linux, before mlx.core)
from mlx_kvlingo.chat.session import finish_thread
from mlx_kvlingo.pairs.builtin import builtin_session

KEYWORDS = ("explain", "why", "prove", "step by step", "in detail")
LONG_QUESTION_WORDS = 40


def wants_large(message: str) -> bool:
    text = message.lower()
    return len(text.split()) > LONG_QUESTION_WORDS or any(k in text for k in KEYWORDS)


def route(message: str):
    """(model name, message without the command)."""
    if message.startswith("/big"):
        return "large", message[len("/big"):].strip()
    return ("large" if wants_large(message) else "small"), message


def worker(session, jobs: queue.Queue, done: queue.Queue):
    while True:
        job = jobs.get()
        if job is None:
            finish_thread()  # release this thread's MLX streams before it ends
            return
        name, message = job
        try:
            stream = session.generate(name, message, max_tokens=48, stream=True)
            sys.stdout.write(f"{name}> ")
            for r in stream:
                sys.stdout.write(r.text)
                sys.stdout.flush()
            sys.stdout.write(f"\n  [{stream.report.summary()}]\n")
            for w in stream.report.warnings:
                sys.stdout.write(f"  [warning: {w}]\n")
            sys.stdout.flush()
            done.put(stream.report)
        except Exception as e:  # report it and keep serving
            print(f"\nerror: {e}", file=sys.stderr)
            done.put(e)


def main():
    session = builtin_session(log=lambda s: print(s, file=sys.stderr))
    jobs, done = queue.Queue(), queue.Queue()
    thread = threading.Thread(target=worker, args=(session, jobs, done), daemon=True)
    thread.start()
    print("Chat with the small model; '/big ...', long questions and 'explain'/'why' go "
          "to the large one. Ctrl-D ends.")
    for line in sys.stdin:
        message = line.strip()
        if not message:
            continue
        name, message = route(message)
        if not message:
            print("(nothing to send)")
            continue
        jobs.put((name, message))
        done.get()  # one turn at a time in this terminal app
    jobs.put(None)
    thread.join()
    reports = session.reports
    switches = sum(1 for a, b in zip(reports, reports[1:]) if a.model != b.model)
    print(f"{len(reports)} turns, {switches} switches, "
          f"{sum(r.translated for r in reports)} tokens translated instead of re-read.")


if __name__ == "__main__":
    main()
