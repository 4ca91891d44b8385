"""A second driver, as in a notebook: reads the coordinator a finished trainer left behind."""

import json
import sys
import time

import ray


def main(kill: bool) -> None:
    ray.init(address="auto", namespace="profiler", log_to_driver=False)
    h = ray.get_actor("profiler")
    deadline = time.monotonic() + 60  # the node agent may still be compressing the traces
    while True:
        status = ray.get(h.status.remote())
        if time.monotonic() > deadline or not any(w["traces_pending"] for w in status["windows"]):
            break
        time.sleep(0.2)
    out = {"status": status, "kernels": ray.get(h.kernel_summary.remote(top_k=5))}
    if kill:
        ray.get(h.flush_record.remote(30.0))  # (the record is written off the loop)
        ray.kill(h)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main("--kill" in sys.argv)
