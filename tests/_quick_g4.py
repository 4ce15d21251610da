from ds_upipe.tools.ranks import run_ranks
from tests import family_cases

def body(rank, world):
    return {f"{s}_{ck}": family_cases.shared_kv_exchange_case(world, s, ck) for s in (True,) for ck in (None, "non_reentrant")}
