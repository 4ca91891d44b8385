"""A process that registers its stack dump (as a configured rank does), prints where it is, and
sleeps inside ``slow_loader``: a stand-in for a stuck rank, for the stack reader's tests."""

import json
import sys
import time

from worker_ext.rank.stack_dump import enable_stack_dump


def slow_loader(ready: str) -> None:
    print(ready, flush=True)  # said from inside, so a reader never catches the caller instead
    time.sleep(60.0)


def load_batch(ready: str) -> None:
    slow_loader(ready)


if __name__ == "__main__":
    # "--as-cuda": open the Flight Recorder pipe as a CUDA rank would (torch's dump API is the
    # same on CPU; it holds no collective there).
    load_batch(json.dumps(enable_stack_dump(cuda="--as-cuda" in sys.argv)))
