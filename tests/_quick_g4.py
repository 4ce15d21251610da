import sys
from ds_upipe.tools.ranks import run_ranks
from tests import family_cases

def body(rank, world):
    out = {}
    for share in (True, False):
        for ck in (None, "non_reentrant"):
            out[f"{share}_{ck}"] = family_cases.shared_kv_exchange_case(world, share, ck)
    return out
