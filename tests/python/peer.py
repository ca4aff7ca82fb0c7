"""A ferry node in a process of its own for the Python tests: publishes what `mode` says,
prints {"url": ...} on one line, and runs until its stdin closes."""

import json
import sys

import ferry
import helpers
import numpy as np

mode, data_dir = sys.argv[1], sys.argv[2]
node = ferry.Node(data_dir, sync=False)
keep = []
if mode == "array":
    # "array": 1 MiB of pattern(…, seed 1); "rows": every other 4 KiB of it (128 pieces).
    a = helpers.pattern(1 << 20)
    region = node.register(a)
    node.publish("array", region)
    node.publish("rows", ferry.Layout().add_strided(region, 0, helpers.PAGE, 2 * helpers.PAGE, 128))
elif mode == "state_dict":
    node.publish_state_dict("model", helpers.state_dict(seed=1))
elif mode == "kv":
    # A pool of 64 pages (pattern seed 2); request 7's pages are 5, 9, 2 and 33, in that order.
    pool = node.register(helpers.pattern(64 * helpers.PAGE, seed=2))
    node.publish("req-7", ferry.kv_pages(pool, helpers.PAGE, np.array([5, 9, 2, 33], np.uint32)),
                 durable=False)
else:
    sys.exit(f"unknown mode {mode}")
print(json.dumps({"url": node.url, "id": node.id}), flush=True)
sys.stdin.read()
node.stop()
