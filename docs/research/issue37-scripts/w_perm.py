"""Q5: does gloo's all_reduce result depend on which process holds which rank? 4 processes; in round k,
process p takes rank perm_k[p]; the input is either the rank's data (seeded by rank) or the process's data."""
import os, sys, time, datetime, hashlib
import torch, torch.distributed as dist
P = int(os.environ["PROC"]); port = int(os.environ["MASTER_PORT"])
store = dist.TCPStore("127.0.0.1", port, 4, is_master=P == 0, wait_for_workers=True)
perms = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [0, 1, 2, 3]]
out = []
for k, perm in enumerate(perms):
    rank = perm[P]
    dist.init_process_group("gloo", store=dist.PrefixStore(f"round{k}", store), rank=rank, world_size=4)
    for n in (1000, 100_000, 4_000_000):
        for follows in ("rank", "process"):
            g = torch.Generator().manual_seed(1000 + (rank if follows == "rank" else P))
            x = torch.randn(n, generator=g) * 1e3
            for op in ("sum", "avg"):
                y = x.clone()
                if op == "sum":
                    dist.all_reduce(y)
                else:
                    dist.all_reduce(y); y /= 4  # megatron DDP: all_reduce then scale (or pre-divide)
                out.append((k, n, follows, op, hashlib.sha1(y.numpy().tobytes()).hexdigest()[:12]))
    dist.destroy_process_group()
if P == 0:
    import collections
    table = collections.defaultdict(dict)
    for k, n, follows, op, h in out:
        table[(n, follows, op)][k] = h
    print("round permutations:", perms)
    for key, v in table.items():
        same = len(set(v.values())) == 1
        print(f"n={key[0]:>8} data follows {key[1]:8s} {key[2]}: {'IDENTICAL in all rounds' if same else 'DIFFERS'} {v}")
