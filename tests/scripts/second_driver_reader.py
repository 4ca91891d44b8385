"""A second driver, as in a notebook: reads the coordinator a finished trainer left behind."""

import json
import sys

import ray


def main(kill: bool) -> None:
    ray.init(address="auto", namespace="profiler", log_to_driver=False)
    h = ray.get_actor("profiler")
    out = {
        "status": ray.get(h.status.remote()),
        "kernels": ray.get(h.kernel_summary.remote(top_k=5)),
    }
    if kill:
        ray.kill(h)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main("--kill" in sys.argv)
