"""Run a Python module with a stack sampler beside it: collapsed stacks for a flame graph.

    python tools/profiling/sample_stacks.py OUT.txt -m epd_engine serve --model ...

A thread samples every other thread's stack (``sys._current_frames``) every ``EPD_SAMPLE_MS``
milliseconds (default 5) and writes ``thread;frame;...;frame count`` lines to OUT.txt every
few seconds and at exit. No ptrace, so it works where py-spy cannot attach (containers);
it takes the GIL for each sample, so it slows the program a little (about 1 % at 5 ms).
A thread waiting for the GIL is sampled where it waits, as py-spy does.
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import signal
import sys
import threading
import time
from types import FrameType

Counts = collections.Counter[str]
LOCK = threading.Lock()  # the sampler adds while the exit handler writes


def collapse(frame: FrameType | None) -> list[str]:
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return names[::-1]


def sample_forever(out: str, period_s: float, counts: Counts) -> None:
    me = threading.get_ident()
    last_write = time.monotonic()
    while True:
        time.sleep(period_s)
        names = {t.ident: t.name for t in threading.enumerate()}
        with LOCK:
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    stack = [names.get(ident, str(ident)), *collapse(frame)]
                    counts[";".join(stack)] += 1
        if time.monotonic() - last_write > 5:
            write(out, counts)
            last_write = time.monotonic()


def write(out: str, counts: Counts) -> None:
    with LOCK:
        text = "".join(f"{stack} {n}\n" for stack, n in counts.most_common())
    with open(out + ".tmp", "w") as f:
        f.write(text)
    os.replace(out + ".tmp", out)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    counts: Counts = collections.Counter()
    period = float(os.environ.get("EPD_SAMPLE_MS", "5")) / 1000
    threading.Thread(target=sample_forever, args=(out, period, counts), daemon=True).start()
    atexit.register(write, out, counts)

    def write_then_die(signum: int, _frame: object) -> None:
        write(out, counts)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    # uvicorn re-raises SIGTERM after its graceful shutdown, with the handler it found at
    # start; the default one would end the process without running atexit.
    signal.signal(signal.SIGTERM, write_then_die)
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
