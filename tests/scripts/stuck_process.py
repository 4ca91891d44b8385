"""A process that registers its stack dump (as a configured rank does), prints where it is, and
sleeps inside ``slow_loader``: a stand-in for a stuck rank, for the stack reader's tests."""

import json
import sys
import time

from worker_ext.rank.stack_dump import enable_stack_dump


def slow_loader() -> None:
    time.sleep(60.0)


def load_batch() -> None:
    slow_loader()


if __name__ == "__main__":
    # "--as-cuda": open the Flight Recorder pipe as a CUDA rank would (torch's dump API is the
    # same on CPU; it holds no collective there).
    print(json.dumps(enable_stack_dump(cuda="--as-cuda" in sys.argv)), flush=True)
    load_batch()
