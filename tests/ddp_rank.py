"""One rank of a real torch.distributed (gloo) job asking memd for a plan; prints it as JSON.

Usage: ddp_rank.py INIT_FILE RANK WORLD_SIZE ENDPOINT MAX_BATCH TARGET
"""
import dataclasses
import json
import sys

import torch.distributed as dist

from memd import client
from memd.client.training import agreed_plan

init_file, rank, world, endpoint, max_batch, target = sys.argv[1:]
dist.init_process_group("gloo", init_method="file://" + init_file, rank=int(rank), world_size=int(world))
try:
    with client.Session("ddp", endpoint=endpoint, timeout=2.0, max_batch=int(max_batch),
                        target_effective_batch=int(target) if target != "-" else None) as s:
        own = s.plan()
        agreed = agreed_plan(s)
    print(json.dumps({"own": dataclasses.asdict(own), "agreed": dataclasses.asdict(agreed)}))
finally:
    dist.destroy_process_group()
