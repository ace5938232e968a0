"""A daemon client that checks every expert's bytes against the file (each part of a split one):
run in-process or as a script.

`python checker.py ENDPOINT MODEL` prints {"checked": experts, "served": bytes} as JSON.
"""

import concurrent.futures as cf
import json
import sys

from moestream.common.client import IodClient
from moestream.common.layout import ModelLayout


def check_all(endpoint: str, model: str) -> dict:
    lay = ModelLayout(model)
    raw = [open(f.path, "rb").read() for f in lay.files]  # the parts of a split model, in order
    checked = served = 0
    with IodClient(endpoint, expect_fingerprint=lay.fingerprint.as_dict(), name="checker") as c:
        for layer in range(lay.experts.n_layer):
            futs = c.fetch([(layer, e) for e in range(lay.experts.n_expert)])
            for f in cf.as_completed(futs, timeout=30):  # in arrival order: each release frees a slot
                lease = f.result()
                for p in lay.experts.parts(lease.layer, lease.expert):
                    assert bytes(c.part_view(lease, p.name)) == raw[p.file][p.offset:p.offset + p.nbytes], (lease, p.name)
                    served += p.nbytes
                checked += 1
                c.release(lease)
    return {"checked": checked, "served": served}


if __name__ == "__main__":
    print(json.dumps(check_all(sys.argv[1], sys.argv[2])))
